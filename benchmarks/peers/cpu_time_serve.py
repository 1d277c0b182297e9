"""radixserve against llama-server on the same GGUF, each served with one thread and timed by
the CPU time of its whole process tree (API, engine, every thread), so that a machine shared
with other work does not move the figures: time spent descheduled counts for nobody.

    python benchmarks/peers/cpu_time_serve.py --model smollm2 [--rounds 3] [--cap-isa avx2]
    python benchmarks/peers/cpu_time_serve.py --model /work/bench-models/bench-llama-1b-q4_0.gguf

What is measured, per round and for each server in turn (both running, one at a time busy):

* prefill: one request of ``--prompt`` random token ids and one generated token; CPU seconds
  per prompt token (the generated token's cost is included: < 0.5% at 512).
* decode B: B concurrent requests of ``--prompt`` tokens each, once with 1 generated token and
  once with 1 + ``--decode`` tokens; the difference is B x decode tokens at that context.

Every prompt is fresh random ids (no prefix-cache hit in either server; llama-server also runs
with ``cache_prompt: false``), greedy, EOS ignored. The token ids come from one vocabulary
(both servers load the same file, so the same tokenizer). Rates are tokens per CPU-second of
the server: with one thread that is its single-core speed. ``--cap-isa avx2`` runs radixserve
under ``RADIXSERVE_CPU_ISA=avx2`` and llama-server from the AVX2 build
(``LLAMA_ISA=avx2 build_llama.sh``). ``--weight-dtype`` is passed to radixserve (default: its
own ``auto``), e.g. ``gguf-q8`` for the integer-dot linears or ``gguf`` for the expanded blocks.

Beside each decode rate, the fraction of the bandwidth bound it reaches: the bytes a decode
step reads per token (every weight the step streams, as each engine holds it, read from the
GGUF's tensor list: the file's blocks for llama-server and for radixserve's block formats,
2 bytes a weight for its dense bfloat16 model; plus the K/V of every row's context at 2 bytes a
value, both engines' cache dtype) times the tokens per CPU-second, against one thread's read
bandwidth measured here (a sum over 1 GiB, best of 3): both engines run one thread. A small
model can pass 100%: part of its weights stays in the last-level cache between steps.

And beside every rate, the arithmetic it implies against the CPU's measured peak
(``benchmarks/peak_flops.cpp``, one thread): the FLOPs a token costs (2 per weight of every
linear, the lm_head once per generated token and once per prompt, and the attention's QK and PV
over the token's context: full attention, a sliding window only lowers it) times the rate, as a
share of the peak of the arithmetic radixserve's default runs on here (bfloat16 dot products
where the CPU has them natively; capped to AVX2, 256-bit float32 FMAs, the only exact arithmetic
that level has). The last column is the same share for ``--targets`` times llama-server's rate:
a target above 100% cannot be reached by any kernel of that arithmetic on this CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PEERS = Path(os.environ.get("PEERS_DIR", "/opt/peers"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:500]!r}") from None


@dataclass
class Server:
    """One server process (and its children), started and waited for."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    health: str
    proc: subprocess.Popen | None = None
    log: Path = field(default_factory=lambda: Path("/dev/null"))

    def start(self, timeout: float = 600) -> None:
        self.log = Path(f"/tmp/cpu_time_serve-{self.name}-{self.port}.log")
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health}", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy after {timeout} s: {self.log.read_text()[-3000:]}")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the server and every child process so far."""
        root = psutil.Process(self.proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def rss_bytes(self) -> int:
        """Resident memory of the server and every child process (what running it costs)."""
        root = psutil.Process(self.proc.pid)
        total = 0
        for p in [root, *root.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()

    def complete(self, prompt: list[int], n: int) -> int:
        """Run one greedy request; return the tokens it generated."""
        url = f"http://127.0.0.1:{self.port}"
        if self.name == "llama-server":
            out = post(url + "/completion", {"prompt": prompt, "n_predict": n, "temperature": 0,
                                             "ignore_eos": True, "cache_prompt": False})
            return int(out["tokens_predicted"])
        out = post(url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": n,
                                             "temperature": 0, "ignore_eos": True})
        return int(out["usage"]["completion_tokens"])


def radixserve_server(model: str, port: int, cap: str | None, batch: int, ctx: int,
                      weight_dtype: str | None = None) -> Server:
    env = dict(os.environ)
    if cap:
        env["RADIXSERVE_CPU_ISA"] = cap
    argv = [sys.executable, "-m", "radixserve", "serve", "--model", model, "--port", str(port),
            "--served-model-name", "m", "--num-threads", "1",
            "--kv-cache-tokens", str(max(8192, batch * ctx * 2)), "--max-running-requests", str(max(8, batch))]
    if weight_dtype:
        argv += ["--weight-dtype", weight_dtype]
    return Server("radixserve", argv, env, port, "/health")


def llama_server(gguf: str, port: int, cap: str | None, batch: int, ctx: int) -> Server:
    build = "llama-build-avx2" if cap == "avx2" else "llama-build"
    binary = os.environ.get("LLAMA_SERVER", str(PEERS / build / "bin" / "llama-server"))
    argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-tb", "1",
            "-c", str(batch * ctx), "--parallel", str(batch), "--cont-batching", "--no-webui"]
    return Server("llama-server", argv, dict(os.environ), port, "/health")


def gguf_path(model: str) -> str:
    if model.endswith(".gguf"):
        return model
    from radixserve.model.loaders import packages

    path = getattr(packages, f"{model}_gguf_path")()
    if path is None:
        raise SystemExit(f"no GGUF for {model}")
    return str(path)


class GGUFShape:
    """A GGUF's tensor list and the architecture's metadata numbers (read once)."""

    def __init__(self, gguf_file: str):
        import gguf

        self._r = gguf.GGUFReader(gguf_file)
        self.tensors = self._r.tensors
        self.arch = str(bytes(self._r.fields["general.architecture"].parts[-1]), "utf-8")
        heads = self.meta("attention.head_count")
        self.head_dim = self.meta("attention.key_length") if f"{self.arch}.attention.key_length" in self._r.fields \
            else self.meta("embedding_length") // heads

    def meta(self, key: str) -> int:
        return int(self._r.fields[f"{self.arch}.{key}"].parts[-1][0])


@dataclass
class StepBytes:
    """What a decode step reads, from the GGUF's tensor list and metadata."""

    blocks: int  # the streamed weights as the file holds them
    values: int  # their number of weights (2 bytes each when held dense in bfloat16)
    kv_per_token: int  # K and V of one context token, 2 bytes a value

    @classmethod
    def of(cls, gguf_file: str) -> "StepBytes":
        g = GGUFShape(gguf_file)
        names = {t.name for t in g.tensors}
        # The embedding is streamed only as the tied lm_head; otherwise a step reads its rows.
        streamed = [t for t in g.tensors if t.name != "token_embd.weight" or "output.weight" not in names]
        return cls(sum(int(t.n_bytes) for t in streamed), sum(int(t.n_elements) for t in streamed),
                   2 * g.meta("block_count") * g.meta("attention.head_count_kv") * g.head_dim * 2)

    def per_token(self, dense: bool, batch: int, ctx: float) -> float:
        return ((2 * self.values if dense else self.blocks) + batch * ctx * self.kv_per_token) / batch


@dataclass
class StepFlops:
    """What a token costs in arithmetic, from the GGUF's tensor list and metadata."""

    linear: int  # weights of every matmul a token runs through, the lm_head excluded
    head: int  # weights of the lm_head (the tied embedding where there is no output.weight)
    attn_per_ctx: int  # FLOPs of QK and PV per context token, all layers

    @classmethod
    def of(cls, gguf_file: str) -> "StepFlops":
        g = GGUFShape(gguf_file)
        by_name = {t.name: int(t.n_elements) for t in g.tensors}
        head = by_name.get("output.weight", by_name["token_embd.weight"])
        # Matmul weights are the 2-D tensors of the blocks (norms are 1-D).
        linear = sum(int(t.n_elements) for t in g.tensors
                     if t.name.startswith("blk.") and len([d for d in t.shape if d > 1]) == 2)
        return cls(linear, head, 2 * 2 * g.meta("block_count") * g.meta("attention.head_count") * g.head_dim)

    def prefill_per_token(self, prompt: int) -> float:
        """FLOPs per prompt token of a prefill that returns one token's logits."""
        return 2 * self.linear + 2 * self.head / prompt + self.attn_per_ctx * (prompt + 1) / 2

    def decode_per_token(self, ctx: float) -> float:
        return 2 * (self.linear + self.head) + self.attn_per_ctx * ctx


def arithmetic_peak(cap: str | None) -> tuple[str, float]:
    """(name, FLOP/s) of one thread's peak in the arithmetic radixserve's default uses here."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from bench_linear import measured_peaks
    from radixserve.kernels.isa import native_bf16

    if cap == "avx2":
        return "256-bit float32 FMA", measured_peaks(1, 256)["float32"]
    if native_bf16():
        return "512-bit bf16 dot products", measured_peaks(1, 512)["bfloat16"]
    return "512-bit float32 FMA", measured_peaks(1, 512)["float32"]


def read_bandwidth() -> float:
    """One thread's read bandwidth in bytes per second: a sum over 1 GiB, best of 3."""
    import numpy as np

    buf = np.ones(1 << 27, dtype=np.float64)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best


def timed(server: Server, prompts: list[list[int]], n: int) -> float:
    """CPU seconds the server spends on ``prompts`` run concurrently, ``n`` tokens each."""
    before = server.cpu_seconds()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: server.complete(p, n), prompts))
    spent = server.cpu_seconds() - before
    if got != [n] * len(prompts):
        raise RuntimeError(f"{server.name} generated {got}, wanted {n} each")
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a .gguf path")
    ap.add_argument("--rounds", type=int, default=3, help="0: start, report memory, stop")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--cap-isa", default=None, choices=[None, "avx2"])
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn below this")
    ap.add_argument("--weight-dtype", default=None, help="radixserve's --weight-dtype (default: its auto)")
    ap.add_argument("--targets", default="prefill=2,decode B=1=1.1,decode B=8=2",
                    help="MEASUREMENT=X,...: the last column's multiple of llama-server's rate")
    args = ap.parse_args()
    gguf = gguf_path(args.model)
    rs_model = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}.get(args.model, gguf)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.prompt + args.decode + 16
    rng = random.Random(0)

    def fresh() -> list[int]:
        return [rng.randrange(100, args.vocab) for _ in range(args.prompt)]

    servers = [radixserve_server(rs_model, free_port(), args.cap_isa, max(batches), ctx, args.weight_dtype),
               llama_server(gguf, free_port(), args.cap_isa, max(batches), ctx)]
    rates: dict[tuple[str, str], list[float]] = {}
    rss: dict[str, int] = {}
    dense = {"llama-server": False}
    try:
        for s in servers:
            s.start()
            rss[s.name] = s.rss_bytes()
            if s.name == "radixserve":
                info = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{s.port}/server_info").read())
                dense["radixserve"] = info["stats"]["weight_dtype"] == "dense"  # as chosen, not as asked
            timed(s, [fresh()], 4)  # warm-up: first-request allocations and kernels
        for r in range(args.rounds):
            for s in servers:
                pre = timed(s, [fresh()], 1)
                rates.setdefault((s.name, "prefill"), []).append(args.prompt / pre)
                for b in batches:
                    one = timed(s, [fresh() for _ in range(b)], 1)
                    more = timed(s, [fresh() for _ in range(b)], 1 + args.decode)
                    rates.setdefault((s.name, f"decode B={b}"), []).append(b * args.decode / (more - one))
            print(f"round {r + 1}: " + ", ".join(f"{k[0]} {k[1]} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    finally:
        for s in servers:
            s.stop()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    size = Path(gguf).stat().st_size
    print("\nresident memory after load (process tree): "
          + ", ".join(f"{k} {v / 2**20:.0f} MiB ({v / size:.2f}x the file)" for k, v in rss.items())
          + f"; file {size / 2**20:.0f} MiB")
    if not args.rounds:
        return
    print(f"\n{args.model} ({Path(gguf).name}), {cpu}, cap {args.cap_isa or 'none'}, radixserve weights "
          f"{args.weight_dtype or 'auto'}, one thread each, "
          f"tokens per CPU-second of the server's process tree, {args.rounds} rounds, median (rounds)")
    step, bw = StepBytes.of(gguf), read_bandwidth()
    print(f"one thread's read bandwidth {bw / 1e9:.1f} GB/s; a decode step's weights: radixserve "
          f"{(2 * step.values if dense['radixserve'] else step.blocks) / 2**20:.0f} MiB, llama-server "
          f"{step.blocks / 2**20:.0f} MiB; K/V {step.kv_per_token} bytes per context token")
    flops, (peak_name, peak) = StepFlops.of(gguf), arithmetic_peak(args.cap_isa)
    targets = {k.strip(): float(v) for k, v in (t.rsplit("=", 1) for t in args.targets.split(",") if t)}
    print(f"one thread's peak in {peak_name}: {peak / 1e9:.0f} GFLOP/s (benchmarks/peak_flops.cpp); "
          f"a token: {flops.prefill_per_token(args.prompt) / 1e9:.2f} GFLOP in a {args.prompt}-token prefill, "
          f"{flops.decode_per_token(args.prompt + (1 + args.decode) / 2) / 1e9:.2f} GFLOP decoding")
    print("| measurement | radixserve | llama-server | ratio (rounds) | bandwidth bound reached, "
          "radixserve / llama-server | radixserve GFLOP/s (of peak) | target x llama-server needs |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in ["prefill", *[f"decode B={b}" for b in batches]]:
        a, b = rates[("radixserve", m)], rates[("llama-server", m)]
        per = ", ".join(f"{x / y:.2f}" for x, y in zip(a, b))
        frac = ""
        ctx_mid = args.prompt + (1 + args.decode) / 2
        if m != "prefill":
            bsz = int(m.split("=")[1])
            frac = " / ".join(f"{statistics.median(r) * step.per_token(dense[n], bsz, ctx_mid) / bw:.0%}"
                              for n, r in (("radixserve", a), ("llama-server", b)))
        per_tok = flops.prefill_per_token(args.prompt) if m == "prefill" else flops.decode_per_token(ctx_mid)
        ours = statistics.median(a) * per_tok
        need = ""
        if m in targets:
            x = targets[m]
            need = f"{x:g}x: {x * statistics.median(b) * per_tok / 1e9:.0f} GFLOP/s ({x * statistics.median(b) * per_tok / peak:.0%})"
        print(f"| {m} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | "
              f"{statistics.median([x / y for x, y in zip(a, b)]):.2f} ({per}) | {frac} | "
              f"{ours / 1e9:.0f} ({ours / peak:.0%}) | {need} |")


if __name__ == "__main__":
    main()
