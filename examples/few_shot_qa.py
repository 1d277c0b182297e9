"""Few-shot question answering: one shared few-shot prefix, many questions (run_batch).

Every program starts with the same examples, so after the first one the radix cache serves
the prefix and only each question is computed.
"""

from __future__ import annotations

from _backend import setup

from radixserve.lang import function, gen

EXAMPLES = (
    "Question: What is the capital of France?\nAnswer: Paris\n\n"
    "Question: How many legs does a spider have?\nAnswer: Eight\n\n"
    "Question: Who wrote Romeo and Juliet?\nAnswer: William Shakespeare\n\n"
)


@function
def few_shot_qa(s, question: str):
    s += "Answer each question briefly.\n\n" + EXAMPLES
    s += "Question: " + question + "\nAnswer:"
    s += gen("answer", max_tokens=16, stop="\n")


if __name__ == "__main__":
    setup(__doc__.splitlines()[0])
    questions = ["What is the largest planet in the solar system?", "What is the chemical symbol for water?",
                 "In which continent is Kenya?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], temperature=0)
    for q, st in zip(questions, states):
        meta = st.get_meta_info("answer")
        print(f"{q}\n  -> {st['answer'].strip()}   (cached {meta.cached_tokens}/{meta.prompt_tokens} prompt tokens)")
