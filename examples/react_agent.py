"""A ReAct-style agent loop: think, pick a tool with select, call it in Python, observe.

The tool choice is a select over the tool names (no parsing of free text), and every step
extends the same transcript, so each request reuses the cached transcript so far.
"""

from __future__ import annotations

import ast
import operator

from _backend import setup

from radixserve.lang import function, gen, select

FACTS = {"eiffel tower": "The Eiffel Tower is 330 metres tall.",
         "mount everest": "Mount Everest is 8849 metres tall."}


def search(query: str) -> str:
    q = query.lower()
    return next((v for k, v in FACTS.items() if k in q), "No result.")


def calculate(expr: str) -> str:
    """Arithmetic only (a tiny safe evaluator, never eval())."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(expr.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


TOOLS = {"search": search, "calculate": calculate}

# One worked example: a 135M model follows a format it has seen far better than one it is told.
EXAMPLE = (
    "Question: What is 12 times the number of legs of a spider?\n"
    "Thought 1: I need the number of legs of a spider.\n"
    "Action 1: search[spider legs]\n"
    "Observation 1: A spider has 8 legs.\n"
    "Thought 2: Now multiply 12 by 8.\n"
    "Action 2: calculate[12 * 8]\n"
    "Observation 2: 96\n"
    "Thought 3: I have the answer.\n"
    "Action 3: finish[96]\n\n"
)


@function
def react(s, question: str, max_steps: int = 4):
    s += ("Answer the question using tools. Tools: search[query], calculate[expression], finish[answer].\n"
          + EXAMPLE + "Question: " + question + "\n")
    for step in range(max_steps):
        s += f"Thought {step + 1}:" + gen(f"thought{step}", max_tokens=32, temperature=0, stop="\n")
        s += f"\nAction {step + 1}:" + select(f"action{step}", choices=[" search", " calculate", " finish"])
        s += "[" + gen(f"input{step}", max_tokens=24, temperature=0, stop=["]", "\n"]) + "]\n"
        action, arg = s[f"action{step}"].strip(), s[f"input{step}"]
        if action == "finish":
            s.set_var("answer", arg)
            return
        s += f"Observation {step + 1}: {TOOLS[action](arg)}\n"
    s.set_var("answer", "(no answer within the step budget)")


if __name__ == "__main__":
    setup(__doc__.splitlines()[0])
    st = react.run(question="How much taller is Mount Everest than the Eiffel Tower, in metres?")
    print(st.text())
    print("answer:", st["answer"])
