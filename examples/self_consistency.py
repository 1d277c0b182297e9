"""Self-consistency: fork several sampled reasoning paths and take a majority vote.

The question is sent once as a prefill hint at the fork; the paths then decode together
in one batch, each computing only its own tokens.
"""

from __future__ import annotations

from collections import Counter

from _backend import setup

from radixserve.lang import function, gen


@function
def self_consistency(s, question: str, paths: int = 5):
    s += "Solve the problem, then give the final number after 'Answer:'.\n\n"
    s += ("Problem: Ann has 2 bags with 5 pears each and gives away 3 pears. How many are left?\n"
          "Reasoning: 2 bags times 5 pears is 10 pears. 10 minus 3 is 7.\nAnswer: 7\n\n")
    s += "Problem: " + question + "\nReasoning:"
    forks = s.fork(paths)
    for f in forks:
        f += gen("reasoning", max_tokens=48, temperature=0.8, stop="Answer:")
        f += "Answer:" + gen("answer", max_tokens=6, temperature=0, stop="\n")
    forks.join()
    # Paths that produced no answer do not vote.
    votes = Counter(a.strip().rstrip(".") for a in s["answer"] if a.strip())
    s.set_var("vote", votes.most_common(1)[0][0] if votes else None)


if __name__ == "__main__":
    setup(__doc__.splitlines()[0])
    st = self_consistency.run(question="Tom has 3 boxes with 4 apples each and eats 2 apples. How many are left?")
    for i, a in enumerate(st["answer"]):
        print(f"path {i}: {a.strip()!r}")
    print("majority vote:", st["vote"])
