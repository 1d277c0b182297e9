"""Tree of thought: propose thoughts in parallel, judge each with select, expand the best.

Each level forks from the text so far; the judge is a 2-way select scored by prompt
logprobs (no sampling), so the search is deterministic given the thoughts.
"""

from __future__ import annotations

from _backend import setup

from radixserve.lang import function, gen, select


def expand(s, width: int):
    """Fork ``width`` next thoughts, return them best first by the judge's score."""
    forks = s.fork(width)
    for f in forks:
        f += "\nNext step:" + gen("thought", max_tokens=24, temperature=0.8, stop="\n")
        f += "\nIs this step correct and useful?" + select("judge", choices=[" yes", " no"])
    forks.join()
    score = lambda f: f.get_meta_info("judge").normalized_logprobs[0]  # noqa: E731
    return sorted(forks, key=score, reverse=True)


@function
def tree_of_thought(s, question: str, width: int = 3, depth: int = 2):
    s += "Think step by step.\nQuestion: " + question
    path = []
    for _ in range(depth):
        best = expand(s, width)[0]
        path.append(best["thought"].strip())
        s += "\nNext step: " + path[-1]
    s += "\nFinal answer:" + gen("answer", max_tokens=32, temperature=0, stop="\n")
    s.set_var("path", path)


if __name__ == "__main__":
    setup(__doc__.splitlines()[0])
    st = tree_of_thought.run(question="How can I keep a sourdough starter alive while on a two-week trip?")
    for i, t in enumerate(st["path"]):
        print(f"step {i + 1}: {t}")
    print("answer:", st["answer"].strip())
