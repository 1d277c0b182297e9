"""Seeded workload generators with the sharing patterns of the RadixAttention paper (§5).

A workload is a sequence of *rounds*. A round is a list of :class:`BenchRequest` (text
prompts, so any OpenAI-compatible server can run them); a round may depend on the outputs
of the previous one (multi-turn chat, tree of thought, agents). :meth:`Workload.rounds`
returns a generator: ``next(gen)`` gives round 0, ``gen.send(outputs)`` (a dict request id
-> generated text) gives the next round, ``StopIteration`` ends it. Runners submit each
round as one batch (offline) or as a Poisson stream (online).

Lengths are in tokens of the tokenizer handed to :func:`make_workload` (text is cut from
real ShareGPT paragraphs, see :mod:`radixserve.bench.data`); without a tokenizer they are
approximated as 4 characters per token. The same seed and tokenizer give the same prompts.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.bench.data import load_conversations, text_pool, word_pool

__all__ = ["BenchRequest", "Workload", "WORKLOADS", "make_workload", "drive", "TextSizer"]

Outputs = dict[str, str]
RoundGen = Generator[list["BenchRequest"], Outputs, None]


class _Tok(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload round."""

    id: str
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True  # fixed output lengths, as serving benchmarks do
    round: int = 0


@dataclass
class Workload:
    """A named, parametrised, seeded workload; ``rounds()`` starts a fresh generator."""

    name: str
    params: dict[str, Any]
    _factory: Callable[[], RoundGen] = field(repr=False)
    description: str = ""

    def rounds(self) -> RoundGen:
        return self._factory()

    @property
    def label(self) -> str:
        return self.name


def drive(workload: Workload, respond: Callable[[list[BenchRequest]], Outputs]) -> list[list[BenchRequest]]:
    """Run a workload's rounds with ``respond`` producing each round's outputs; returns rounds."""
    gen = workload.rounds()
    out: list[list[BenchRequest]] = []
    try:
        reqs = next(gen)
        while True:
            out.append(reqs)
            reqs = gen.send(respond(reqs))
    except StopIteration:
        pass
    return out


class TextSizer:
    """Cuts real text to token budgets with a tokenizer (or ~4 chars/token without one)."""

    def __init__(self, tokenizer: _Tok | None, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        self.pool = text_pool()
        self.words = word_pool()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text)) if self.tok is not None else max(1, len(text) // 4)

    def fit(self, text: str, n: int) -> str:
        if self.tok is None:
            return text[: 4 * n]
        ids = self.tok.encode(text)
        return self.tok.decode(ids[:n]) if len(ids) > n else text

    def text(self, n: int) -> str:
        """About ``n`` tokens of real text, starting at a random paragraph."""
        i = self.rng.randrange(len(self.pool))
        parts: list[str] = []
        total = 0
        while total < n:
            p = self.pool[i % len(self.pool)]
            parts.append(p)
            total += self.count(p) + 1
            i += 1
        return self.fit(" ".join(parts), n).strip()

    def word(self) -> str:
        return self.rng.choice(self.words)


def _mc_item(s: TextSizer, n: int, answer: bool) -> str:
    q = s.text(n)
    opts = "\n".join(f"{c}. {s.word()} {s.word()}" for c in "ABCD")
    a = f" {s.rng.choice('ABCD')}\n\n" if answer else ""
    return f"Question: {q}\n{opts}\nAnswer:{a}"


def few_shot(tok: _Tok | None = None, seed: int = 0, num_questions: int = 16, shots: int = 5,
             prefix_tokens: int = 600, question_tokens: int = 40, max_tokens: int = 1) -> RoundGen:
    """MMLU-like: one k-shot prefix shared by every question; a 1-token answer each."""
    s = TextSizer(tok, random.Random(seed))
    header = "The following are multiple choice questions (with answers).\n\n"
    # Calibrate the per-example overhead (options, labels) so the prefix lands near target.
    overhead = s.count(_mc_item(TextSizer(tok, random.Random(seed + 1)), 8, True)) - 8
    per_shot = max(8, (prefix_tokens - s.count(header)) // max(1, shots) - overhead)
    prefix = header + "".join(_mc_item(s, per_shot, True) for _ in range(shots))
    yield [BenchRequest(f"fs-{i}", prefix + _mc_item(s, question_tokens, False), max_tokens)
           for i in range(num_questions)]


def two_level(tok: _Tok | None = None, seed: int = 0, num_contexts: int = 4, endings: int = 4,
              shots: int = 3, prefix_tokens: int = 400, context_tokens: int = 80,
              ending_tokens: int = 20, max_tokens: int = 1) -> RoundGen:
    """HellaSwag-like: shared few-shot prefix -> a context -> ``endings`` candidate endings."""
    s = TextSizer(tok, random.Random(seed))
    per_shot = max(8, prefix_tokens // max(1, shots))
    prefix = "Pick the most plausible continuation.\n\n" + "".join(
        f"Context: {s.text(per_shot - ending_tokens)}\nEnding: {s.text(ending_tokens)}\n"
        f"Plausible: yes\n\n" for _ in range(shots)
    )
    reqs = []
    for c in range(num_contexts):
        ctx = prefix + f"Context: {s.text(context_tokens)}\nEnding:"
        for e in range(endings):
            reqs.append(BenchRequest(f"tl-{c}-{e}", ctx + f" {s.text(ending_tokens)}\nPlausible:",
                                     max_tokens))
    yield reqs


_CHAT_SYSTEM = "A chat between a curious user and a helpful assistant.\n"


def _conversations(rng: random.Random, n: int, turns: int) -> list:
    """``n`` ShareGPT conversations with ``turns`` user turns, drawn from the first ``max(64, 4n)``."""
    convs = list(load_conversations(max(64, 4 * n), turns))
    rng.shuffle(convs)
    return convs[:n]


def multi_turn(tok: _Tok | None = None, seed: int = 0, num_conversations: int = 8, turns: int = 3,
               output: str = "short", turn_tokens: int = 64, long_tokens: int = 256) -> RoundGen:
    """ShareGPT multi-turn chat: turn n's prompt carries turns 1..n-1 (with the model's replies).
    ``output="short"``: 4-8 tokens per reply; ``"long"``: ``long_tokens`` per reply."""
    if output not in ("short", "long"):
        raise ValueError(f"output must be 'short' or 'long', got {output!r}")
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    convs = _conversations(rng, num_conversations, turns)
    history = [_CHAT_SYSTEM for _ in convs]
    for t in range(turns):
        reqs = []
        for i, c in enumerate(convs):
            user = s.fit(c.human[t % len(c.human)], turn_tokens)
            history[i] += f"User: {user}\nAssistant:"
            n = rng.randint(4, 8) if output == "short" else long_tokens
            reqs.append(BenchRequest(f"mt-{i}-t{t}", history[i], n, round=t))
        outs = yield reqs
        for i in range(len(convs)):
            history[i] += f"{(outs or {}).get(f'mt-{i}-t{t}', '')}\n"


def multi_turn_tiered(tok: _Tok | None = None, seed: int = 0, num_conversations: int = 24,
                      turns: int = 4, turn_tokens: int = 48, reply_tokens: int = 48,
                      max_tokens: int = 4) -> RoundGen:
    """Multi-turn chat with the dataset's own replies: each round, every conversation sends its
    history plus a new user turn; the history then grows by that turn and the dataset's reply
    (not the model's: every engine configuration sees the same prompts). A conversation comes
    back only after all the others have run, so with many conversations its prefix has to
    survive a long reuse window: the workload of ``radixserve bench --hicache``."""
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    convs = _conversations(rng, num_conversations, turns)
    history = [_CHAT_SYSTEM for _ in convs]
    for t in range(turns):
        reqs = []
        for i, c in enumerate(convs):
            history[i] += f"User: {s.fit(c.human[t % len(c.human)], turn_tokens)}\nAssistant:"
            reqs.append(BenchRequest(f"mtt-{i}-t{t}", history[i], max_tokens, round=t))
            reply = c.gpt[t % len(c.gpt)] if c.gpt else s.text(reply_tokens)
            history[i] += f" {s.fit(reply, reply_tokens)}\n"
        yield reqs


def self_consistency(tok: _Tok | None = None, seed: int = 0, num_questions: int = 1,
                     samples: int = 8, question_tokens: int = 128, max_tokens: int = 32,
                     temperature: float = 0.8) -> RoundGen:
    """One question, ``samples`` parallel samples (different seeds) of the same prompt."""
    s = TextSizer(tok, random.Random(seed))
    reqs = []
    for q in range(num_questions):
        prompt = f"Question: {s.text(question_tokens)}\nLet's think step by step.\n"
        for k in range(samples):
            reqs.append(BenchRequest(f"sc-{q}-{k}", prompt, max_tokens, temperature,
                                     seed=seed * 1000 + q * samples + k))
    yield reqs


def tree_of_thought(tok: _Tok | None = None, seed: int = 0, branching: int = 2, depth: int = 3,
                    question_tokens: int = 96, step_tokens: int = 16,
                    temperature: float = 0.8) -> RoundGen:
    """Tree of thought: each of ``depth`` rounds extends every node with ``branching`` samples."""
    s = TextSizer(tok, random.Random(seed))
    root = f"Solve the problem by exploring several lines of thought.\nProblem: {s.text(question_tokens)}\n"
    frontier: list[tuple[str, str]] = [("tot", root)]  # (node id, text so far)
    for d in range(depth):
        reqs = []
        for nid, text in frontier:
            for b in range(branching):
                reqs.append(BenchRequest(f"{nid}-{b}", f"{text}Step {d + 1}:", step_tokens,
                                         temperature, seed=zlib.crc32(f"{seed}/{nid}/{b}".encode()) & 0x7FFFFFFF,
                                         round=d))
        outs = yield reqs
        frontier = [(r.id, f"{r.prompt}{(outs or {}).get(r.id, '')}\n") for r in reqs]


def agent(tok: _Tok | None = None, seed: int = 0, num_agents: int = 4, steps: int = 4,
          template_tokens: int = 400, task_tokens: int = 48, observation_tokens: int = 32,
          max_tokens: int = 24) -> RoundGen:
    """ReAct-like agents: a fixed tool template + a per-agent trajectory growing each step."""
    s = TextSizer(tok, random.Random(seed))
    tools = ["search", "calculator", "lookup", "python", "calendar", "weather"]
    per_tool = max(8, template_tokens // len(tools) - 8)
    template = (
        "Answer the task by interleaving Thought, Action and Observation steps.\n"
        "You can use the following tools:\n"
        + "".join(f"- {t}: {s.text(per_tool)}\n" for t in tools)
        + "Use the format:\nThought: ...\nAction: tool[input]\nObservation: ...\n\n"
    )
    trajs = [f"{template}Task: {s.text(task_tokens)}\n" for _ in range(num_agents)]
    for k in range(steps):
        reqs = [BenchRequest(f"ag-{a}-s{k}", f"{trajs[a]}Thought:", max_tokens, round=k)
                for a in range(num_agents)]
        outs = yield reqs
        for a, r in enumerate(reqs):
            trajs[a] = (f"{r.prompt}{(outs or {}).get(r.id, '')}\n"
                        f"Observation: {s.text(observation_tokens)}\n")


def sharegpt(tok: _Tok | None = None, seed: int = 0, num_requests: int = 32,
             max_prompt_tokens: int = 256, max_tokens: int = 32) -> RoundGen:
    """ShareGPT first turns, no deliberate sharing: measures the tree's overhead."""
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    convs = list(load_conversations(max(128, 2 * num_requests)))
    rng.shuffle(convs)
    seen: set[str] = set()
    reqs = []
    for c in convs:
        p = s.fit(c.human[0], max_prompt_tokens)
        if p in seen:
            continue
        seen.add(p)
        reqs.append(BenchRequest(f"sg-{len(reqs)}", p, max_tokens))
        if len(reqs) == num_requests:
            break
    yield reqs


def generated_shared_prefix(tok: _Tok | None = None, seed: int = 0, groups: int = 4,
                            prompts_per_group: int = 8, system_tokens: int = 512,
                            question_tokens: int = 64, max_tokens: int = 16) -> RoundGen:
    """SGLang's generated-shared-prefix shape: G groups x P prompts, S-token system prompt,
    Q-token question, O output tokens. Requests are interleaved across groups."""
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    systems = [s.text(system_tokens) + "\n" for _ in range(groups)]
    reqs = [BenchRequest(f"gsp-{g}-{p}", systems[g] + s.text(question_tokens), max_tokens)
            for g in range(groups) for p in range(prompts_per_group)]
    rng.shuffle(reqs)
    yield reqs


def memory_pressure(tok: _Tok | None = None, seed: int = 0, num_systems: int = 64,
                    system_tokens: int = 1000, questions: int = 4, question_tokens: int = 32,
                    max_tokens: int = 8, order: str = "shuffled") -> RoundGen:
    """Many long system prompts, a few questions each: a working set several times the KV pool
    (run it with ``--kv-cache-tokens`` about a quarter of ``num_systems * system_tokens``).

    ``order="shuffled"``: every request in one round, shuffled. Reuse happens only if an engine
    keeps a system prompt until its next question, or serves a system prompt's questions
    together. ``order="rounds"``: ``questions`` rounds, one after another, each holding one
    question per system prompt in a shuffled order (many agents or tenants, each with its own
    long system prompt, taking turns): a prompt's questions are never in the engine together,
    so every hit is a prefix the cache kept through the other prompts' turns."""
    if order not in ("shuffled", "rounds"):
        raise ValueError(f"order must be 'shuffled' or 'rounds', got {order!r}")
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    systems = [s.text(system_tokens) + "\n" for _ in range(num_systems)]
    reqs = [BenchRequest(f"mp-{g}-{q}", systems[g] + s.text(question_tokens), max_tokens,
                         round=q if order == "rounds" else 0)
            for g in range(num_systems) for q in range(questions)]
    if order == "shuffled":
        rng.shuffle(reqs)
        yield reqs
        return
    for q in range(questions):
        turn = reqs[q::questions]  # question q of every system prompt
        rng.shuffle(turn)
        yield turn


def branching(tok: _Tok | None = None, seed: int = 0, branching: int = 3, depth: int = 4,
              root_tokens: int = 50, segment_tokens: tuple[int, int] = (5, 13),
              min_depth: int = 2, max_tokens: int = 4) -> RoundGen:
    """A tree of prompts with short segments: every node at depth >= ``min_depth`` is a
    request whose prompt is its root-to-node path. Forks fall at token positions that are
    rarely multiples of 16 or 32, where a block-granular cache (block hashing) loses the
    partial block that a token-exact tree keeps."""
    rng = random.Random(seed)
    s = TextSizer(tok, rng)
    lo, hi = segment_tokens
    root = s.text(root_tokens)
    reqs: list[BenchRequest] = []
    frontier = [("", root)]
    for d in range(1, depth + 1):
        nxt = []
        for name, text in frontier:
            for b in range(branching):
                child = f"{name}{b}"
                t = text + " " + s.text(rng.randint(lo, hi))
                nxt.append((child, t))
                if d >= min_depth:
                    reqs.append(BenchRequest(f"br-{child}", t, max_tokens))
        frontier = nxt
    rng.shuffle(reqs)
    yield reqs


WORKLOADS: dict[str, tuple[Callable[..., RoundGen], str]] = {
    "few-shot": (few_shot, "MMLU-like k-shot prefix + distinct question, 1-token answer"),
    "two-level": (two_level, "HellaSwag-like shared prefix -> context -> 4 endings"),
    "multi-turn-short": (lambda **kw: multi_turn(output="short", **kw),
                         "ShareGPT multi-turn chat, 4-8 token replies"),
    "multi-turn-long": (lambda **kw: multi_turn(output="long", **kw),
                        "ShareGPT multi-turn chat, 256-token replies"),
    "multi-turn-tiered": (multi_turn_tiered, "multi-turn chat with the dataset's replies, rounds "
                                             "far apart (radixserve bench --hicache)"),
    "self-consistency": (self_consistency, "one question, n parallel samples"),
    "tree-of-thought": (tree_of_thought, "branching b, depth d, children extend parents"),
    "agent": (agent, "ReAct-like tool template + growing trajectory"),
    "sharegpt": (sharegpt, "ShareGPT first turns, no sharing (tree overhead)"),
    "gsp": (generated_shared_prefix, "generated shared prefix: G groups x P prompts"),
    "memory-pressure": (memory_pressure, "64 long system prompts x 4 questions, shuffled "
                                         "(order=rounds: one question each per round); "
                                         "working set ~4x the KV pool"),
    "branching": (branching, "tree of prompts, forks at unaligned positions, short segments"),
}


def make_workload(name: str, tokenizer: _Tok | None = None, seed: int = 0, **params: Any) -> Workload:
    """A workload by name (see ``WORKLOADS``) with its size parameters."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    fn, desc = WORKLOADS[name]
    # Resolve text once so every rounds() generator sees identical prompts.
    load_conversations(512)

    def factory() -> RoundGen:
        return fn(tok=tokenizer, seed=seed, **params)

    # Validate parameters eagerly (unknown keyword -> TypeError -> ValueError here).
    try:
        gen = factory()
        next(gen)
        gen.close()
    except TypeError as e:
        raise ValueError(f"bad parameters for workload {name!r}: {e}") from None
    return Workload(name, dict(params, seed=seed), factory, desc)
