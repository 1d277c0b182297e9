"""Model forward benchmark: our paged-KV Llama vs transformers on the same weights, each
figure next to the machine's ceiling for it.

Prints a markdown table. Not a test. Run:  ``python benchmarks/bench_model.py [--quick]``

What is measured, and how (so the numbers can be trusted):

* prefill tok/s: one prompt of 512 / 2048 tokens, batch 1. Ours: one ForwardBatch into
  shuffled pool slots (logits of the last token), with the default "torch" backend (CPU
  kernels) and the "torch-eager" reference. transformers: ``model(ids,
  past_key_values=DynamicCache(), logits_to_keep=1)`` with SDPA attention — what
  ``generate()`` does for a prefill.
* prefill ceiling = GEMM peak ÷ FLOPs per token. The peak is measured here, on the model's
  own packed linear layers at the prompt's row count (the best rate these shapes reach on
  this machine); FLOPs per token = 2 × the linear weights + the causal attention's
  4 · heads · head_dim · (n + 1) / 2 per layer (+ the lm_head's one row, spread over n).
  share = measured / ceiling.
* decode tok/s: B sequences (1, 8, 32), each with a 512-token context, ``--steps`` steps
  of one token each; tok/s = B / (fastest step). The contexts are produced by one
  real 512-token prefill whose K/V is copied to every sequence (content does not change the
  cost). Ours: ForwardBatch.build + forward per step (batch building is counted).
  transformers: the same prefill's DynamicCache ``batch_repeat_interleave``-d to B, then
  ``model(ids[B,1], past_key_values=cache)`` per step (its cache grows by torch.cat, which is
  its real behaviour; contexts are equal length so no left padding is needed — the most
  favourable case for it).
* decode ceiling = B ÷ the larger of (bytes read per step ÷ memory bandwidth) and (FLOPs
  per step ÷ the prefill GEMM peak); at B=32 the compute bound binds. Bytes: every linear
  weight and the lm_head once, plus each sequence's K and V in every layer. Bandwidth: the
  best of a few full reads (``sum``) of a 512 MB buffer, measured right after each batch
  size's steps (a VM's bandwidth moves with its neighbours on the host).
* paged vs contiguous decode: the same model and math, but the attention backend reads a
  dense per-request cache instead of the pool by slot index. The ratio is the price of
  paging. Contenders, all in the same interleaved loop:

  - ``paged served`` (ours, the ``ours`` column): the default "torch" backend over the shared
    pool, with slots the way the engine gets them in a busy server: from a ``SlotAllocator``
    after 3,000 scheduler-like steps of 32 requests of random length finishing in random
    order (``helpers_model.churned_allocator``), the prompt in one allocation and then one
    slot per request per step, interleaved across requests. On CPU the paged attention
    kernel of ``kernels/csrc`` reads K/V in place through the slot table.
  - ``paged shuffled``: the same over a fully random permutation of slots — the worst case,
    which our allocator does not produce (it hands pages out in ascending runs).
  - ``paged in-order``: the same with in-order slot ids.
  - ``paged eager``: the "torch-eager" backend — per layer one ``index_select`` of K/V into a
    buffer, bf16->fp32 copy, two ``bmm`` (the reference path).
  - ``contiguous``: ``DenseCacheBackend``, each request's K/V contiguous in a dense cache,
    in two flavours, each the best for its layout: ``kernel`` = the very same attention
    kernel reading the dense cache ``[B * Lcap, kv_heads, D]`` through the identity slot table
    ``b * Lcap + l`` (no gather; "the same forward with a contiguous per-request cache"), and
    ``eager`` = grouped-query ``matmul`` on strided views of a head-major
    ``[B, kv_heads, Lcap, D]`` cache (bf16 caches converted to fp32 per layer, as the eager
    attention runs in fp32). paged/contiguous divides by the faster of the two.

All timings are best-of-N (see ``_time``), identically for every contender.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for p in (_ROOT / "src", _ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from helpers_model import build_hf_model, churned_allocator, shuffled_allocator  # noqa: E402
from radixserve.engine.runner import ModelRunner  # noqa: E402
from radixserve.memory.allocator import SlotAllocator  # noqa: E402
from radixserve.memory.kv_pool import zeros_on_huge_pages  # noqa: E402
from radixserve.model.arch.attention_eager import EagerTorchAttentionBackend, TorchAttentionMetadata  # noqa: E402
from radixserve.model.arch.attention_kernel import KernelAttentionMetadata, TorchAttentionBackend  # noqa: E402
from radixserve.model.model_config import ModelConfig  # noqa: E402
from radixserve.model.arch.forward_batch import ForwardBatch  # noqa: E402
from radixserve.kernels.isa import describe  # noqa: E402

CTX = 512


class DenseCacheBackend(TorchAttentionBackend):
    """Contiguous-cache baseline for decode: each request's K/V in one dense block per layer.

    ``kernel=True``: the same paged attention kernel as the pool, over a token-major cache
    ``[2, B * Lcap, kv_heads, D]`` read through the identity slot table ``b * Lcap + l``.
    ``kernel=False``: the eager float32 math of the reference path (grouped-query matmuls,
    additive mask) on strided views of a head-major cache ``[2, B, kv_heads, Lcap, D]`` — no
    gather. Only for this benchmark: every sequence has the same length, so the new token
    goes to one column.
    """

    def __init__(self, pool_kv: torch.Tensor, ctx_slots: torch.Tensor, batch: int, cap: int,
                 kernel: bool):
        super().__init__(device=pool_kv.device)  # the row-wise kernels serve both flavours
        if kernel and not self.uses_kernels:
            raise RuntimeError("the CPU kernels are unavailable")
        self.kernel = kernel
        layers, _, _, nkv, d = pool_kv.shape
        self.batch, self.cap = batch, cap
        ctx = pool_kv[:, :, ctx_slots]  # [layers, 2, L, kv_heads, D]
        n = ctx.shape[2]
        if kernel:
            # Same memory as the pool (2 MB pages where available): only the layout differs.
            self.cache = zeros_on_huge_pages((layers, 2, batch, cap, nkv, d), pool_kv.dtype,
                                             pool_kv.device)
            self.cache[:, :, :, :n] = ctx[:, :, None]
            self.cache = self.cache.view(layers, 2, batch * cap, nkv, d)
        else:
            self.cache = zeros_on_huge_pages((layers, 2, batch, nkv, cap, d), pool_kv.dtype,
                                             pool_kv.device)
            self.cache[:, :, :, :, :n] = ctx.permute(0, 1, 3, 2, 4)[:, :, None]

    def prepare(self, batch: ForwardBatch, kv_pool):
        pos = batch.prefix_lens[0]
        if self.kernel:
            base = torch.arange(self.batch, dtype=torch.int64)[:, None] * self.cap
            slots = (base + torch.arange(pos + 1, dtype=torch.int64)).reshape(-1)
            info = torch.tensor([[b, 1, b * (pos + 1), pos + 1] for b in range(self.batch)],
                                dtype=torch.int64)
            return KernelAttentionMetadata(out_slots=base[:, 0] + pos, slots=slots, seq_info=info,
                                           num_tokens=self.batch, num_decode=self.batch)
        meta = EagerTorchAttentionBackend.prepare(self, batch, kv_pool)
        meta.pos = pos  # type: ignore[attr-defined]
        return meta

    def forward(self, q, k_new, v_new, layer_id, kv_pool, metadata):
        c = self.cache[layer_id]
        b, nh, d = q.shape
        if self.kernel:  # c: [2, B * Lcap, kv_heads, D]
            self.kernels.store_kv(k_new, v_new, c[0], c[1], metadata.out_slots)
            out = torch.empty((b, nh * d), dtype=q.dtype)
            return self.kernels.attention(q, c[0], c[1], metadata.slots, metadata.seq_info, out,
                                          d**-0.5)
        pos = metadata.pos
        c[0, :, :, pos] = k_new.to(c.dtype)  # c: [2, B, kv_heads, Lcap, D]
        c[1, :, :, pos] = v_new.to(c.dtype)
        k = c[0, :, :, : pos + 1]
        v = c[1, :, :, : pos + 1]
        if k.dtype != torch.float32:
            k, v = k.float(), v.float()
        qg = q.float().view(b, k.shape[1], nh // k.shape[1], d) * (d**-0.5)
        scores = torch.matmul(qg, k.transpose(-1, -2)) + metadata.decode_bias
        return torch.matmul(torch.softmax(scores, -1), v).reshape(b, nh * d)


def _time(fn, reps: int) -> float:
    """Best of ``reps`` runs: the machine is shared, and the minimum is the least noisy
    estimate of what the code costs (applied identically to every contender)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def linear_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's fused qkv, o, gate_up and down projections."""
    h, d = config.hidden_size, config.head_dim
    return [((config.num_heads + 2 * config.num_kv_heads) * d, h), (h, config.num_heads * d),
            (2 * config.intermediate_size, h), (h, config.intermediate_size)]


def gemm_peak(runner: ModelRunner, rows: int, reps: int) -> float:
    """FLOP/s of the model's own linear layers (packed as served) on ``rows`` rows: the best
    of ``reps`` passes over every layer's four projections."""
    model = runner.model
    linear = model.linears
    names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    shapes = linear_shapes(model.config)
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=gen).to(linear.act_dtype) for _, k in shapes}
    ws = [(getattr(layer, n), shapes[i][1]) for layer in model.layers for i, n in enumerate(names)]

    def run() -> None:
        for w, k in ws:
            linear(xs[k], w)

    run()
    flops = 2 * rows * sum(o * k for o, k in shapes) * len(model.layers)
    return flops / _time(run, reps)


def mem_bandwidth(reps: int = 5, nbytes: int = 512 << 20) -> float:
    """Bytes/s of a full read of an ``nbytes`` buffer on all threads, best of ``reps``: the
    best of torch's ``sum`` (float32 and bfloat16) and the plain vectorised read loop of
    ``benchmarks/peak_flops.cpp`` (a VM's bandwidth moves with its neighbours on the host).
    A decode ceiling passes the bytes its step reads: a large last-level cache holds part of
    a buffer of that size, and the step gets the same help the probe does."""
    best = 0.0
    for dt in (torch.float32, torch.bfloat16):
        buf = torch.ones(nbytes // torch.empty(0, dtype=dt).element_size(), dtype=dt)
        best = max(best, buf.numel() * buf.element_size() / _time(lambda: buf.sum(), reps))
        del buf
    probe = _bandwidth_probe()
    if probe is not None:
        # On 4 KB pages and on 2 MB ones (where the packed weights and the KV pool live).
        for buf in (torch.ones(nbytes // 4, dtype=torch.float32),
                    zeros_on_huge_pages((nbytes // 4,), torch.float32, torch.device("cpu")).add_(1.0)):
            best = max(best, probe(ctypes.c_void_p(buf.data_ptr()), buf.numel(), torch.get_num_threads(), reps))
            del buf
    return best


def _bandwidth_probe():
    """``radixserve_read_bandwidth`` of benchmarks/peak_flops.cpp, or None if it cannot be built."""
    from radixserve.kernels import builder

    try:
        lib = ctypes.CDLL(str(builder.build("radixserve_peak", [Path(__file__).with_name("peak_flops.cpp")])))
    except (builder.KernelBuildError, OSError):
        return None
    fn = lib.radixserve_read_bandwidth
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    return fn


def flops_per_token(config: ModelConfig, n: int) -> tuple[float, float]:
    """(linear, attention) FLOPs per token of an n-token prefill, causal attention counted
    exactly: token i attends to i + 1 keys."""
    lin = 2 * sum(o * k for o, k in linear_shapes(config)) * config.num_layers
    lin += 2 * config.vocab_size * config.hidden_size / n  # one lm_head row
    attn = 4 * config.num_heads * config.head_dim * (n + 1) / 2 * config.num_layers
    return lin, attn


def decode_bytes(config: ModelConfig, b: int, ctx: int, dtype: torch.dtype) -> float:
    """Bytes one decode step must read: every weight once (lm_head included), and each
    sequence's K and V of every layer."""
    elt = torch.empty(0, dtype=dtype).element_size()
    weights = sum(o * k for o, k in linear_shapes(config)) * config.num_layers
    weights += config.vocab_size * config.hidden_size
    kv = b * (ctx + 1) * config.num_layers * 2 * config.num_kv_heads * config.head_dim
    return (weights + kv) * elt


def bench_dtype(config: ModelConfig, sd32: dict, dtype: torch.dtype, args) -> list[dict]:
    sd = {k: v.to(dtype) for k, v in sd32.items()}
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    rows: list[dict] = []
    max_b = max(args.batches)
    # Room for the sets of B sequences held at once (shuffled, eager, in-order, contiguous,
    # served) plus the requests the churned allocator still holds.
    # (the churned allocator alone may hold up to 32 requests of 1,500 tokens).
    cap = max(2 * 6 * max_b * (CTX + args.steps + 2), 2 * 32 * 1500) + max(args.prefill) + 64
    runner = ModelRunner.from_config(config, sd, kv_capacity=cap, dtype=dtype)
    info = runner.kernel_info()
    eager_backend = EagerTorchAttentionBackend()
    kernels_on = runner.attn_backend.uses_kernels
    hf = build_hf_model(config, sd, dtype=dtype, attn_implementation="sdpa")
    from transformers import DynamicCache

    name = str(dtype).replace("torch.", "")
    # ---------------- prefill
    for n in args.prefill:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        alloc = shuffled_allocator(cap, seed=n)
        slots = alloc.alloc(n)

        def ours(attn=None) -> torch.Tensor:
            batch = ForwardBatch.build([prompt], [0], [slots])
            with torch.inference_mode():
                out = runner.model.forward(batch, runner.kv_pool, attn or runner.attn_backend)
            return out.next_token_logits

        ids = torch.tensor([prompt])

        def theirs() -> torch.Tensor:
            with torch.inference_mode():
                out = hf(input_ids=ids, past_key_values=DynamicCache(), logits_to_keep=1)
            return out.logits[0, -1].float()

        diff = (ours()[0] - theirs()).abs().max().item()  # also warms both up
        diff_eager = (ours()[0] - ours(eager_backend)[0]).abs().max().item()
        t_ours = t_eager = t_hf = float("inf")
        peak = 0.0
        for _ in range(args.reps):  # interleaved (the ceiling's GEMM too), best of reps
            t_ours = min(t_ours, _time(ours, 1))
            t_eager = min(t_eager, _time(lambda: ours(eager_backend), 1))
            t_hf = min(t_hf, _time(theirs, 1))
            peak = max(peak, gemm_peak(runner, n, 1))
        lin, attn = flops_per_token(config, n)
        ceiling = peak / (lin + attn)
        rows.append(dict(
            dtype=name, what=f"prefill {n}", ours=n / t_ours, hf=n / t_hf, ceiling=ceiling,
            note=(f"linears {info['linear']} ({info['linear_weights']} weights, {info['activations']} "
                  f"activations), attention {info['attention_impl']}; "
                  f"ceiling = GEMM peak {peak / 1e9:.0f} GFLOP/s (model's linears at {n} rows) ÷ "
                  f"{(lin + attn) / 1e6:.1f} MFLOP/token ({lin / 1e6:.1f} linear + {attn / 1e6:.1f} "
                  f"attention); eager path {n / t_eager:.1f} tok/s; max abs logit diff vs HF "
                  f"{diff:.2e}, vs eager {diff_eager:.2e}"),
        ))
        print(f"  {rows[-1]}", file=sys.stderr)

    # ---------------- decode
    peak = gemm_peak(runner, max(args.prefill), 2)
    prompt = torch.randint(0, vocab, (CTX,), generator=gen).tolist()
    base_alloc = SlotAllocator(cap)
    ctx_slots = base_alloc.alloc(CTX)
    runner.forward(ForwardBatch.build([prompt], [0], [ctx_slots]))
    pool = runner.kv_pool
    with torch.inference_mode():
        hf_cache = DynamicCache()
        hf(input_ids=torch.tensor([prompt]), past_key_values=hf_cache, logits_to_keep=1)

    for b in args.batches:
        toks = torch.randint(0, vocab, (args.steps + 1, b), generator=gen)

        def paged(alloc: SlotAllocator, backend=None, engine_like: bool = False):
            if engine_like:  # as the scheduler allocates: the prompt, then a slot per step
                prompts = [alloc.alloc(CTX) for _ in range(b)]
                steps = [alloc.alloc(b) for _ in range(args.steps + 1)]
                seqs = [torch.cat([p] + [d[j : j + 1] for d in steps]) for j, p in enumerate(prompts)]
            else:
                seqs = [alloc.alloc(CTX + args.steps + 1) for _ in range(b)]
            for s in seqs:  # copy the real context's K/V into each sequence's slots
                pool.kv[:, :, s[:CTX]] = pool.kv[:, :, ctx_slots]
            attn = backend or runner.attn_backend

            def step(i: int) -> None:
                batch = ForwardBatch.build(
                    [[int(t)] for t in toks[i]], [CTX + i] * b, [s[: CTX + i + 1] for s in seqs]
                )
                with torch.inference_mode():
                    runner.model.forward(batch, pool, attn)

            return step

        cache = copy.deepcopy(hf_cache)
        cache.batch_repeat_interleave(b)

        def hf_step(i: int) -> None:
            with torch.inference_mode():
                hf(input_ids=toks[i][:, None], past_key_values=cache)

        # All contenders hold their state at once and their steps are interleaved, so a burst
        # of load from other jobs on the machine hits them alike.
        alloc = shuffled_allocator(cap, seed=b)
        ordered = SlotAllocator(cap)
        ordered.alloc(cap // 2)  # in-order slots from the other half of the pool
        dense_cap = CTX + args.steps + 2
        served = churned_allocator(cap, seed=b)
        contenders = {
            "shuffled": paged(alloc),
            "served": paged(served, engine_like=True),
            "ordered": paged(ordered),
            "eager": paged(alloc, backend=eager_backend),
            "contiguous eager": paged(SlotAllocator(cap), backend=DenseCacheBackend(
                pool.kv, ctx_slots, b, dense_cap, kernel=False)),
            "hf": hf_step,
        }
        if kernels_on:
            contenders["contiguous kernel"] = paged(SlotAllocator(cap), backend=DenseCacheBackend(
                pool.kv, ctx_slots, b, dense_cap, kernel=True))
        best = {k: float("inf") for k in contenders}
        for i in range(args.steps + 1):
            for k, step in contenders.items():
                dt = _time(lambda: step(i), 1)
                if i > 0:  # step 0 is the warm-up
                    best[k] = min(best[k], dt)
        tps = {k: b / v for k, v in best.items()}
        shuffled, contig_slots, eager, hf_tps, served_tps = (
            tps["shuffled"], tps["ordered"], tps["eager"], tps["hf"], tps["served"])
        contiguous = max(tps["contiguous eager"], tps.get("contiguous kernel", 0.0))
        dense_note = f"eager {tps['contiguous eager']:.1f}"
        if kernels_on:
            dense_note = f"kernel {tps['contiguous kernel']:.1f}, " + dense_note
        # Measured right after the contenders: on a shared host the bandwidth a VM gets
        # varies with its neighbours, and the ceiling should describe the same moment.
        nbytes = decode_bytes(config, b, CTX, dtype)
        bandwidth = mem_bandwidth(nbytes=int(nbytes))
        lin, attn = flops_per_token(config, 2 * CTX)  # attention over CTX keys per token
        compute_s = b * (lin + attn) / peak
        ceiling = b / max(nbytes / bandwidth, compute_s)  # whichever binds
        del cache, contenders
        rows.append(dict(
            dtype=name, what=f"decode B={b} ctx {CTX}", ours=served_tps, hf=hf_tps, ceiling=ceiling,
            note=(f"ceiling = the lower of: memory {b * bandwidth / nbytes:.0f} tok/s "
                  f"({nbytes / 1e6:.0f} MB/step ÷ {bandwidth / 1e9:.1f} GB/s), compute "
                  f"{b / compute_s:.0f} tok/s (at the prefill GEMM peak); paged/contiguous: served "
                  f"{served_tps / contiguous:.2f}, shuffled {shuffled / contiguous:.2f}, in-order "
                  f"{contig_slots / contiguous:.2f} (contiguous cache {contiguous:.1f} tok/s "
                  f"[{dense_note}]); eager path on shuffled slots {eager:.1f}"),
        ))
        print(f"  {rows[-1]}", file=sys.stderr)
    return rows


QUALITY_TEXT = (
    "The radix tree keeps the key-value cache of every finished request, keyed by its token "
    "ids. A new request walks the tree from the root, takes the longest cached prefix, and "
    "computes only the tokens that follow it. When memory runs short, leaves are evicted in "
    "least-recently-used order, so shared system prompts and few-shot examples stay resident "
    "while one-off suffixes are dropped first. "
)


def quality_rows(config: ModelConfig, sd32: dict, token_ids: list[int]) -> list[str]:
    """bfloat16 vs float32 on real text, all positions: ours and transformers side by side.

    This is the "equal quality" half of the dtype question: how far each implementation's
    bfloat16 logits move from its own float32 logits, and how often the greedy token changes.
    """
    from radixserve.memory.allocator import SlotAllocator as _SA

    def ours(dtype: torch.dtype) -> torch.Tensor:
        sd = {k: v.to(dtype) for k, v in sd32.items()}
        r = ModelRunner.from_config(config, sd, kv_capacity=len(token_ids) + 8, dtype=dtype)
        slots = _SA(len(token_ids) + 8).alloc(len(token_ids))
        b = ForwardBatch.build([token_ids], [0], [slots], return_all_logits=[True])
        return r.forward(b).all_logits[0]

    def theirs(dtype: torch.dtype) -> torch.Tensor:
        hf = build_hf_model(config, {k: v.to(dtype) for k, v in sd32.items()}, dtype=dtype,
                            attn_implementation="sdpa")
        with torch.inference_mode():
            return hf(input_ids=torch.tensor([token_ids])).logits[0].float()

    out = []
    for name, fn in (("ours", ours), ("transformers", theirs)):
        a, b = fn(torch.float32), fn(torch.bfloat16)
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        kl = torch.nn.functional.kl_div(
            b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean"
        ).item()
        out.append(f"| {name} | {len(token_ids)} | {top1 * 100:.1f}% | {kl:.4f} | "
                   f"{(a - b).abs().mean().item():.4f} | {(a - b).abs().max().item():.3f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-quality", action="store_true", help="skip the bf16-vs-fp32 table")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, small sizes")
    args = ap.parse_args()
    args.prefill = [int(x) for x in args.prefill.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.quick or args.model in ("tiny", "tiny-random"):
        from radixserve.model.testing.tiny import tiny_random_config, tiny_random_state_dict

        config = tiny_random_config(max_position_embeddings=4096)
        sd32 = tiny_random_state_dict(config=config)
        model_name = "tiny-random"
        quality_ids = torch.randint(0, config.vocab_size, (100,),
                                    generator=torch.Generator().manual_seed(1)).tolist()
    else:
        try:
            from radixserve.model.registry import load_model
        except ImportError as e:
            print(f"radixserve.model.registry is not available yet ({e}); "
                  "rerun later or use --quick for the tiny model.")
            return
        loaded = load_model(args.model, dtype=torch.float32)
        config, sd32, model_name = loaded.config, loaded.state_dict, loaded.name
        quality_ids = loaded.tokenizer.encode(QUALITY_TEXT * 3)

    print(f"model {model_name}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"decode steps {args.steps}, prefill reps {args.reps}; CPU {describe()}", file=sys.stderr)
    rows: list[dict] = []
    for dt in args.dtypes.split(","):
        rows += bench_dtype(config, sd32, getattr(torch, dt), args)

    print(f"\n### {model_name} forward throughput (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; CPU {describe()})\n")
    print("| dtype | workload | ours tok/s | ceiling tok/s | share | transformers tok/s | "
          "ours / HF | notes |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['what']} | {r['ours']:.1f} | {r['ceiling']:.0f} | "
              f"{r['ours'] / r['ceiling'] * 100:.0f}% | {r['hf']:.1f} | "
              f"{r['ours'] / r['hf']:.2f}× | {r['note']} |")
    if not args.no_quality:
        print("\n### bfloat16 vs float32 logits (all positions of a real-text prompt)\n")
        print("| implementation | tokens | top-1 agreement | KL(fp32‖bf16) | mean abs diff "
              "| max abs diff |")
        print("|---|---:|---:|---:|---:|---:|")
        for line in quality_rows(config, sd32, quality_ids):
            print(line)


if __name__ == "__main__":
    main()
