"""A hybrid Mamba2 + attention model (Bamba) served with the Mamba radix cache against
``--cache none``, and two snapshot placement policies at equal state memory (not a test:
prints numbers).

The model is the seeded random Bamba that ``tiny-random-mamba-hybrid`` is, built at a size
where compute matters (``--layers``, ``--hidden``; three Mamba2 layers to one attention
layer, as Bamba-9B). Speed does not depend on the weights, and the hit counts do not either
(every request runs its ``max_tokens`` with ``ignore_eos``).

Configurations, each with the same ``max_running_requests`` and, for the two caches, the
same number of snapshot slots (``--snapshots``: equal state memory, printed in MiB):

* ``none``: no prefix cache; every prompt is computed from its first token.
* ``ends``: snapshots at request ends and branch points only (``--mamba-snapshot-interval 0``).
* ``every-N``: also every N tokens of a prefill (``--mamba-snapshot-interval N``).

Workloads (token ids, seeded; the same for every configuration):

* ``multi-turn``: conversations whose every turn repeats the previous turn's prompt and
  answer and adds a user message; a round is one turn of every conversation, run together.
* ``shared-system-prompt``: a few long system prompts, each followed by short questions;
  the requests come in shuffled order, ``--concurrency`` at a time, so the first requests of
  a system prompt arrive before any other request went through it.

Timing: the machine is shared and noisy, so the configurations run in interleaved rounds
(every repeat runs each one on a fresh engine, in a rotated order) with one torch thread,
and each reports its median wall time and median process CPU time over the repeats; the
speed-ups are ratios to ``none`` on the same workload. Engine start-up is not timed.

    python benchmarks/bench_mamba.py                         # 8 layers, hidden 512
    python benchmarks/bench_mamba.py --layers 4 --hidden 128 --repeats 1     # smoke
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

from radixserve import SamplingParams
from radixserve.bench.cli import _machine
from radixserve.engine.engine import Engine
from radixserve.model.registry import LoadedModel, load_model
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

#: One request of a workload: its prompt and how many tokens it generates.
Request = tuple[list[int], int]
#: A workload: rounds of requests; a round may depend on the previous round's outputs.
Rounds = Callable[[list[list[int]] | None], list[Request] | None]


def hybrid_model(layers: int, hidden: int, seed: int = 0) -> LoadedModel:
    """The seeded random Bamba of ``tiny-random-mamba-hybrid`` at ``layers`` x ``hidden``:
    three Mamba2 layers to one attention layer, head_dim 64, Mamba expand 2 with 64-wide
    heads, d_state 64, an MLP of twice the hidden size. ValueError for a size that does not
    divide into such heads."""
    if layers < 1 or hidden < 128 or hidden % 128:
        raise ValueError(f"hidden must be a multiple of 128 (>= 128) and layers >= 1, got {hidden=}, {layers=}")
    types = tuple(("mamba", "mamba", "mamba", "full")[i % 4] for i in range(layers))
    cfg = tiny_random_config(
        "bamba", hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers, layer_types=types,
        num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
        mamba_n_heads=2 * hidden // 64, mamba_head_dim=64, mamba_n_groups=1, mamba_d_state=64)
    tok = load_model("tiny-random-mamba-hybrid").tokenizer  # ids < 512 below: the tiny vocab
    return LoadedModel(cfg, tiny_random_state_dict(seed=seed, config=cfg), tok, f"bamba-random-{layers}x{hidden}")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def multi_turn(seed: int, conversations: int = 4, turns: int = 4, first: int = 256, user: int = 32,
               answer: int = 16) -> Rounds:
    """``conversations`` chats of ``turns`` turns: a first message of ``first`` tokens, then
    each turn the previous prompt, its answer and ``user`` new tokens."""
    rng = random.Random(seed)
    state: dict[str, list] = {"prompts": [], "turn": [0]}

    def next_round(outputs: list[list[int]] | None) -> list[Request] | None:
        turn = state["turn"][0]
        if turn == turns:
            return None
        if turn == 0:
            state["prompts"] = [_ids(rng, first) for _ in range(conversations)]
        else:
            state["prompts"] = [p + o + _ids(rng, user) for p, o in zip(state["prompts"], outputs)]
        state["turn"][0] = turn + 1
        return [(p, answer) for p in state["prompts"]]

    return next_round


def shared_system_prompt(seed: int, systems: int = 4, questions: int = 4, system_len: int = 400,
                         question: int = 24, answer: int = 8) -> Rounds:
    """``systems`` system prompts of ``system_len`` tokens, ``questions`` questions of
    ``question`` tokens behind each, in one round in shuffled order."""
    rng = random.Random(seed)
    prefixes = [_ids(rng, system_len) for _ in range(systems)]
    reqs = [(s + _ids(rng, question), answer) for s in prefixes for _ in range(questions)]
    rng.shuffle(reqs)
    done = [False]

    def next_round(outputs: list[list[int]] | None) -> list[Request] | None:
        if done[0]:
            return None
        done[0] = True
        return reqs

    return next_round


WORKLOADS: dict[str, Callable[[int], Rounds]] = {"multi-turn": multi_turn,
                                                 "shared-system-prompt": shared_system_prompt}


@dataclass
class RunResult:
    """One configuration on one workload, one repeat."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    wall_s: float
    cpu_s: float
    stats: dict


def run(model: LoadedModel, rounds: Rounds, options: dict, concurrency: int) -> RunResult:
    """Every round of ``rounds`` on a fresh engine, at most ``concurrency`` requests in it at
    once; the engine's start is not timed."""
    with Engine(model, **options) as eng:
        n = prompt = cached = 0
        outputs: list[list[int]] | None = None
        w0, c0 = time.perf_counter(), time.process_time()
        while (reqs := rounds(outputs)) is not None:
            queue = list(enumerate(reqs))
            rid_of: dict[str, int] = {}
            got: dict[int, list[int]] = {}
            while len(got) < len(reqs):
                while queue and len(rid_of) - len(got) < concurrency:
                    i, (ids, k) = queue.pop(0)
                    rid_of[eng.add_request(ids, SamplingParams(max_tokens=k, temperature=0, ignore_eos=True))] = i
                for o in eng.step():
                    if o.finished and o.request_id in rid_of:
                        if o.finish_reason not in ("length", "stop"):
                            raise RuntimeError(f"request failed: {o.finish_reason} {o.error}")
                        got[rid_of[o.request_id]] = list(o.token_ids)
                        prompt += o.prompt_tokens
                        cached += o.cached_tokens
            n += len(reqs)
            outputs = [got[i] for i in range(len(reqs))]
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        return RunResult(n, prompt, cached, wall, cpu, eng.stats())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--interval", type=int, default=64, help="N of the every-N placement")
    ap.add_argument("--snapshots", type=int, default=8, help="snapshot slots of both cached configurations")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2,
                    help="shared-system-prompt: requests in the engine at once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="multi-turn,shared-system-prompt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = hybrid_model(args.layers, args.hidden)
    base = {"dtype": "float32", "kv_cache_tokens": 16384, "max_running_requests": args.max_running,
            "chunked_prefill_size": 512, "num_threads": 1}
    configs = {
        "none": {**base, "cache": "none"},
        "ends": {**base, "cache": "radix", "mamba_snapshots": args.snapshots},
        f"every-{args.interval}": {**base, "cache": "radix", "mamba_snapshots": args.snapshots,
                                   "mamba_snapshot_interval": args.interval},
    }
    names = list(configs)
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} — {_machine()}")
    print(f"# model: seeded random Bamba, {args.layers} layers (3 Mamba2 : 1 attention), hidden {args.hidden}, "
          f"float32; max_running_requests {args.max_running}; {args.repeats} interleaved repeats")
    for wl in args.workloads.split(","):
        if wl not in WORKLOADS:
            raise SystemExit(f"unknown workload {wl!r}; choose from {sorted(WORKLOADS)}")
        results: dict[str, list[RunResult]] = {c: [] for c in names}
        for r in range(args.repeats):
            for c in names[r % len(names):] + names[: r % len(names)]:
                conc = args.concurrency if wl == "shared-system-prompt" else args.max_running
                results[c].append(run(model, WORKLOADS[wl](args.seed), configs[c], conc))
        wall0 = statistics.median(x.wall_s for x in results["none"])
        cpu0 = statistics.median(x.cpu_s for x in results["none"])
        print(f"\n## {wl}\n")
        print("| config | snapshot slots (MiB) | snapshots taken (interval) | hit tokens / prompt tokens | "
              "req/s (wall) | speed-up wall | speed-up CPU |")
        print("|---|---|---|---|---|---|---|")
        for c in names:
            xs = results[c]
            x = xs[0]
            wall = statistics.median(y.wall_s for y in xs)
            cpu = statistics.median(y.cpu_s for y in xs)
            st = x.stats
            slots = int(st.get("max_mamba_snapshots", 0))
            mib = slots * st.get("mamba_state_bytes_per_slot", 0) / 2**20
            taken = (f"{int(st.get('mamba_snapshots_taken', 0))} ({int(st.get('mamba_interval_snapshots_taken', 0))})"
                     if slots else "—")
            print(f"| {c} | {slots} ({mib:.1f}) | {taken} | {x.cached_tokens} / {x.prompt_tokens} "
                  f"({x.cached_tokens / x.prompt_tokens:.1%}) | {x.requests / wall:.2f} | "
                  f"{wall0 / wall:.2f}x | {cpu0 / cpu:.2f}x |")


if __name__ == "__main__":
    main()
