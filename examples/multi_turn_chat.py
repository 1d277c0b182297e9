"""A multi-turn chat with the model's chat template; the last turn is streamed.

Every turn re-sends the whole conversation, and the radix cache serves all earlier turns.
"""

from __future__ import annotations

from _backend import setup

from radixserve.lang import assistant, function, gen, system, user


@function
def chat(s, turns: list[str]):
    s += system("You are a concise, friendly assistant.")
    for i, q in enumerate(turns):
        s += user(q)
        s += assistant(gen(f"reply{i}", max_tokens=48, temperature=0))


if __name__ == "__main__":
    setup(__doc__.splitlines()[0])
    turns = ["Hi! What is a good name for a pet turtle?", "Why that name?", "Give me one more idea."]
    st = chat.run(turns=turns[:-1])
    for i, q in enumerate(turns[:-1]):
        print(f"user: {q}\nassistant: {st[f'reply{i}']}\n")
    # Stream the last turn: the same program with one more turn; its text up to the earlier
    # turns is what we already printed, so show only what comes after, as it arrives.
    streamed = chat.run(turns=turns, stream=True)
    seen, skip = 0, len(st.text())
    for chunk in streamed.text_iter():
        if seen + len(chunk) > skip:
            print(chunk[max(0, skip - seen):], end="", flush=True)
        seen += len(chunk)
    last = streamed.get_meta_info(f"reply{len(turns) - 1}")
    print(f"\n(cached {last.cached_tokens}/{last.prompt_tokens} prompt tokens on the last turn)")
