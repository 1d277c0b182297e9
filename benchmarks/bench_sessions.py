"""Multi-turn hit rate with and without session ids under SWA pressure (not a test: prints numbers).

A hybrid model (the tiny random Gemma 3: 6 layers, 4 sliding with window 12, 2 full) with a
full-attention pool large enough for everything and a small sliding-window (SWA) pool. In
each round, turn ``t`` of every conversation is submitted together with unrelated filler
requests (interleaved), and the engine runs until all are done; turn ``t + 1`` of a
conversation is its turn ``t`` prompt + answer + new user tokens. The fillers' prefills need
more SWA slots than the pool has free, so the tree tombstones SWA KV: without a session the
previous turn's window goes and the next turn misses (it recomputes the conversation from
the last boundary with an intact window, usually the start); with a session id the
scheduler keeps a lock on the conversation's cached end (sched/sessions.py) and the next
turn hits all of it.

Reported per mode: hit rate of the conversations' later turns (cached prompt tokens /
prompt tokens, turns >= 2), how many of those turns hit the whole previous conversation,
the overall hit rate (fillers included), prefill tokens computed, requests/s and wall time
over wall time and over this process's CPU time (best of ``--repeats`` by wall time, modes
alternating, since the machine is shared), and whether the
two modes produced the same tokens (greedy; they must).

    python benchmarks/bench_sessions.py
    python benchmarks/bench_sessions.py --conversations 16 --turns 5 --swa-tokens 384
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "src"))

import torch  # noqa: E402

from radixserve import SamplingParams  # noqa: E402
from radixserve.kernels.isa import describe, effective_isa  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.registry import LoadedModel, load_model  # noqa: E402
from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict  # noqa: E402


def _model(name: str) -> LoadedModel:
    if name != "tiny-gemma3":
        return load_model(name, dtype=torch.float32)
    cfg = tiny_random_config("gemma3")
    tok = load_model("tiny-random", dtype=torch.float32).tokenizer
    return LoadedModel(cfg, tiny_random_state_dict(seed=0, config=cfg), tok, "tiny-gemma3")


def _run(loaded: LoadedModel, args: argparse.Namespace, sessions: bool) -> dict:
    eng = Engine(loaded, cache="radix", dtype="float32", max_prefill_tokens=args.max_prefill, kv_cache_tokens=args.kv_tokens,
                 swa_kv_cache_tokens=args.swa_tokens, page_size=args.page_size,
                 max_running_requests=args.max_running, num_threads=args.threads)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    convs = [[rng.randrange(3, 500) for _ in range(args.first_tokens)] for _ in range(args.conversations)]
    prev = [0] * args.conversations  # tokens of the previous turn with KV (what can be hit)
    ps = args.page_size
    outputs: list[list[int]] = []
    later_prompt = later_cached = whole = later_turns = 0
    n_req = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for turn in range(args.turns):
        rids: dict[str, int] = {}
        fillers = [[rng.randrange(3, 500) for _ in range(args.filler_tokens)]
                   for _ in range(args.fillers)]
        order = [("c", c) for c in range(args.conversations)] + [("f", f) for f in range(args.fillers)]
        rng.shuffle(order)
        for kind, i in order:
            if kind == "c":
                sid = f"conv-{i}" if sessions else None
                rids[eng.add_request(convs[i], params, session_id=sid)] = i
            else:
                eng.add_request(fillers[i], params)
            n_req += 1
        done = {o.request_id: o for o in eng.run_until_done()}
        for rid, c in sorted(rids.items(), key=lambda kv: kv[1]):
            o = done[rid]
            outputs.append(o.token_ids)
            if turn:
                later_turns += 1
                later_prompt += len(convs[c])
                later_cached += o.cached_tokens
                whole += o.cached_tokens >= prev[c]
            prev[c] = (len(convs[c]) + len(o.token_ids) - 1) // ps * ps
            convs[c] = convs[c] + o.token_ids + [rng.randrange(3, 500) for _ in range(args.user_tokens)]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    eng.check_integrity()
    st = eng.stats()
    return {"later_hit": later_cached / max(1, later_prompt), "whole": whole, "later_turns": later_turns,
            "hit": st["prefix_cache_hit_rate"], "prefill": st["computed_prefill_tokens"],
            "req_s": n_req / wall, "wall": wall, "cpu": cpu, "req_cpu_s": n_req / cpu, "outputs": outputs, "requests": n_req,
            "tombstoned": eng.cache.swa_kv.tombstoned_tokens, "shed": st["sessions_shed"],
            "held": st["session_retained_tokens"], "steps": st["steps"],
            "retractions": st["retractions"], "swa_capacity": eng.allocator.swa.capacity,
            "kv_capacity": eng.allocator.capacity}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-gemma3",
                    help="tiny-gemma3 (random weights) or a hybrid model radixserve loads, e.g. gemma3-270m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=64, help="first prompt of a conversation")
    ap.add_argument("--user-tokens", type=int, default=16, help="new user tokens per later turn")
    ap.add_argument("--output-tokens", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--fillers", type=int, default=8, help="unrelated requests per round")
    ap.add_argument("--filler-tokens", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=8192, help="full-attention pool (tokens)")
    ap.add_argument("--swa-tokens", type=int, default=256, help="sliding-window pool (tokens)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--max-prefill", type=int, default=4096, help="most prompt tokens per step")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = _model(args.model)
    mc = loaded.config
    n_swa = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
    print(f"# {platform.node() or 'host'}: {describe()}, kernels at {effective_isa()}, torch "
          f"{torch.__version__} ({args.threads} thread(s)), Python {platform.python_version()}")
    print(f"# {args.model} (window {mc.sliding_window}, {n_swa} sliding + {mc.num_layers - n_swa} full layers), "
          f"float32; "
          f"pools: {args.kv_tokens} full-attention tokens, {args.swa_tokens} SWA tokens, page {args.page_size}")
    print(f"# {args.conversations} conversations x {args.turns} turns (first prompt {args.first_tokens}, "
          f"+{args.user_tokens} user tokens per turn, {args.output_tokens} generated), "
          f"{args.fillers} filler requests of {args.filler_tokens} tokens per round, interleaved; "
          f"max {args.max_running} running; best of {args.repeats}")
    best: dict[bool, dict] = {}
    for rep in range(args.repeats):
        for sessions in ((False, True) if rep % 2 == 0 else (True, False)):
            r = _run(loaded, args, sessions)
            if sessions not in best or r["wall"] < best[sessions]["wall"]:
                best[sessions] = r
    off, on = best[False], best[True]
    print(f"{'mode':<14}{'later-turn hit':>15}{'whole prev':>12}{'overall hit':>12}{'prefill tok':>12}"
          f"{'steps':>7}{'req/s':>9}{'req/cpu-s':>10}{'wall s':>8}{'SWA tombstoned':>16}{'retract':>9}{'sheds':>7}")
    for name, r in (("no sessions", off), ("session ids", on)):
        print(f"{name:<14}{r['later_hit']:>15.1%}{r['whole']:>7}/{r['later_turns']:<4}{r['hit']:>12.1%}"
              f"{r['prefill']:>12}{r['steps']:>7}{r['req_s']:>9.3g}{r['req_cpu_s']:>10.3g}{r['wall']:>8.2f}{r['tombstoned']:>16}"
              f"{r['retractions']:>9}{r['shed']:>7}")
    print(f"outputs equal: {'yes' if off['outputs'] == on['outputs'] else 'NO'}; "
          f"prefill tokens saved by sessions: {off['prefill'] - on['prefill']} "
          f"({(off['prefill'] - on['prefill']) / max(1, off['prefill']):.1%}); "
          f"req/s ratio (sessions / none): {on['req_s'] / off['req_s']:.2f} wall, "
          f"{on['req_cpu_s'] / off['req_cpu_s']:.2f} CPU time; "
          f"tokens kept by sessions at the end: {on['held']}")


if __name__ == "__main__":
    main()
