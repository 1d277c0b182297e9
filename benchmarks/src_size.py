"""The size of ``src/radixserve``'s Python per package at two git revisions (not a test).

    python benchmarks/src_size.py 11a8b60 HEAD

Per package (a folder under ``src/radixserve``; ``top`` for the files directly in it): all lines
(``wc -l``), and how they split into code, docstrings, comments and blank lines, plus the
code's tokens (names, operators, literals; docstrings and comments excluded). Lines alone
move when code is merely re-wrapped; the tokens say whether code went away.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tokenize
from collections import Counter
from pathlib import PurePosixPath

ROOT = "src/radixserve"
KINDS = ("lines", "code", "doc", "comment", "blank", "tokens")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def measure(source: str) -> Counter:
    """Lines by kind and code tokens of one module."""
    lines = source.splitlines()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    comment: set[int] = set()
    tokens = 0
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#"):
            comment.add(tok.start[0])
        elif tok.type not in skip and tok.start[0] not in doc:
            tokens += 1
    blank = sum(1 for line in lines if not line.strip())
    c = Counter(lines=len(lines), doc=len(doc), comment=len(comment - doc), blank=blank, tokens=tokens)
    c["code"] = c["lines"] - c["doc"] - c["comment"] - c["blank"]
    return c


def sizes(rev: str) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for path in git("ls-tree", "-r", "--name-only", rev, ROOT).split():
        if not path.endswith(".py"):
            continue
        parts = PurePosixPath(path).relative_to(ROOT).parts
        pkg = parts[0] if len(parts) > 1 else "top"
        out.setdefault(pkg, Counter()).update(measure(git("show", f"{rev}:{path}")))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args(argv)
    a, b = sizes(args.before), sizes(args.after)
    print(f"{'package':<12}" + "".join(f"{k:>26}" for k in KINDS))
    total_a, total_b = Counter(), Counter()
    for pkg in sorted(set(a) | set(b)):
        x, y = a.get(pkg, Counter()), b.get(pkg, Counter())
        total_a.update(x)
        total_b.update(y)
        print(f"{pkg:<12}" + "".join(f"{f'{x[k]} -> {y[k]} ({y[k] - x[k]:+d})':>26}" for k in KINDS))
    print(f"{'all':<12}" + "".join(f"{f'{total_a[k]} -> {total_b[k]} ({total_b[k] - total_a[k]:+d})':>26}"
                                   for k in KINDS))


if __name__ == "__main__":
    main()
