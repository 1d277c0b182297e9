"""Model forward benchmark: our paged-KV Llama vs transformers on the same weights.

Prints a markdown table. Not a test. Run:  ``python benchmarks/bench_model.py [--quick]``

What is measured, and how (so the numbers can be trusted):

* prefill tok/s: one prompt of 512 / 2048 tokens, batch 1. Ours: one ForwardBatch into
  shuffled pool slots (logits of the last token). transformers: ``model(ids,
  past_key_values=DynamicCache(), logits_to_keep=1)`` with SDPA attention — what
  ``generate()`` does for a prefill.
* decode tok/s: B sequences (1, 8, 32), each with a 512-token context, ``--steps`` steps
  of one token each; tok/s = B / (fastest step). The contexts are produced by one
  real 512-token prefill whose K/V is copied to every sequence (content does not change the
  cost). Ours: ForwardBatch.build + forward per step (batch building is counted).
  transformers: the same prefill's DynamicCache ``batch_repeat_interleave``-d to B, then
  ``model(ids[B,1], past_key_values=cache)`` per step (its cache grows by torch.cat, which is
  its real behaviour; contexts are equal length so no left padding is needed — the most
  favourable case for it).
* paged vs contiguous decode: the same model and math, but the attention backend reads a
  dense per-request cache instead of the pool by slot index. The ratio is the price of
  paging. Contenders, all in the same interleaved loop:

  - ``paged served`` (ours, the ``ours`` column): the default "torch" backend over the shared
    pool, with slots the way the engine gets them in a busy server: from a ``SlotAllocator``
    after 3,000 scheduler-like steps of 32 requests of random length finishing in random
    order (``helpers_model.churned_allocator``), the prompt in one allocation and then one
    slot per request per step, interleaved across requests. On CPU it decodes with the
    fused kernel of ``radixserve.model.paged_decode`` (scores read K rows in place through
    the slot index, torch softmax, P·V reads V rows in place; nothing is gathered), else
    the eager path.
  - ``paged shuffled``: the same over a fully random permutation of slots — the worst case,
    which our allocator does not produce (it hands pages out in ascending runs).
  - ``paged in-order``: the same with in-order slot ids.
  - ``paged eager``: the "torch-eager" backend — per layer one ``index_select`` of K/V into a
    buffer, bf16->fp32 copy, two ``bmm`` (the pre-kernel path, for reference).
  - ``contiguous``: ``DenseCacheBackend``, each request's K/V contiguous in a dense cache,
    in two flavours, each the best for its layout: ``fused`` = the very same kernel reading
    the dense cache ``[B * Lcap, kv_heads, D]`` through the identity index ``b * Lcap + l``
    (no gather; this is "the same forward with a contiguous per-request cache"), and
    ``eager`` = grouped-query ``matmul`` on strided views of a head-major
    ``[B, kv_heads, Lcap, D]`` cache (bf16 caches converted to fp32 per layer, as attention
    runs in fp32). paged/contiguous divides by the faster of the two.

All timings are best-of-N (see ``_time``), identically for every contender.
"""

from __future__ import annotations

import argparse
import copy
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
from radixserve.model.attention import (  # noqa: E402
    EagerTorchAttentionBackend,
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402

CTX = 512


class DenseCacheBackend(TorchAttentionBackend):
    """Contiguous-cache baseline for decode: each request's K/V in one dense block per layer.

    ``fused=True``: the same fused decode kernel as the paged backend, over a token-major
    cache ``[2, B * Lcap, kv_heads, D]`` read through the identity index ``b * Lcap + l``.
    ``fused=False``: the eager float32 math of the paged path (grouped-query matmuls, additive
    mask) on strided views of a head-major cache ``[2, B, kv_heads, Lcap, D]`` — no gather.
    Only for this benchmark: every sequence has the same length, so the new token goes to one
    column.
    """

    def __init__(self, pool_kv: torch.Tensor, ctx_slots: torch.Tensor, batch: int, cap: int,
                 fused: bool):
        super().__init__(device=pool_kv.device, fused_decode=fused)
        self.fused = fused
        if fused and not self.fused_decode:
            raise RuntimeError("fused decode kernel unavailable")
        layers, _, _, nkv, d = pool_kv.shape
        self.batch, self.cap = batch, cap
        ctx = pool_kv[:, :, ctx_slots]  # [layers, 2, L, kv_heads, D]
        n = ctx.shape[2]
        if fused:
            # Same memory as the pool (2 MB pages where available): only the layout differs.
            self.cache = zeros_on_huge_pages((layers, 2, batch, cap, nkv, d), pool_kv.dtype,
                                             pool_kv.device)
            self.cache[:, :, :, :n] = ctx[:, :, None]
            self.cache = self.cache.view(layers, 2, batch * cap, nkv, d)
        else:
            self.cache = zeros_on_huge_pages((layers, 2, batch, nkv, cap, d), pool_kv.dtype,
                                             pool_kv.device)
            self.cache[:, :, :, :, :n] = ctx.permute(0, 1, 3, 2, 4)[:, :, None]

    def prepare(self, batch: ForwardBatch, kv_pool) -> TorchAttentionMetadata:
        meta = super().prepare(batch, kv_pool)
        pos = batch.prefix_lens[0]
        meta.pos = pos  # type: ignore[attr-defined]
        if self.fused:
            base = torch.arange(self.batch, dtype=torch.int64)[:, None] * self.cap
            meta.decode_index = base + torch.arange(pos + 1, dtype=torch.int64)
            meta.dense_slots = base[:, 0] + pos  # type: ignore[attr-defined]
        return meta

    def forward(self, q, k_new, v_new, layer_id, kv_pool, metadata):
        pos = metadata.pos
        c = self.cache[layer_id]
        b, nh, d = q.shape
        if self.fused:  # c: [2, B * Lcap, kv_heads, D]
            c.index_copy_(1, metadata.dense_slots, torch.stack((k_new, v_new)).to(c.dtype))
            return self._fused_decode(q.float(), c, metadata).reshape(b, nh * d)
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


def bench_dtype(config: ModelConfig, sd32: dict, dtype: torch.dtype, args) -> list[dict]:
    sd = {k: v.to(dtype) for k, v in sd32.items()}
    gen = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    rows: list[dict] = []
    max_b = max(args.batches)
    # Room for the sets of B sequences held at once (shuffled, eager, in-order, contiguous,
    # served) plus the requests the churned allocator still holds.
    cap = 2 * 6 * max_b * (CTX + args.steps + 2) + max(args.prefill) + 64
    runner = ModelRunner.from_config(config, sd, kv_capacity=cap, dtype=dtype)
    hf = build_hf_model(config, sd, dtype=dtype, attn_implementation="sdpa")
    from transformers import DynamicCache

    name = str(dtype).replace("torch.", "")
    # ---------------- prefill
    for n in args.prefill:
        prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
        alloc = shuffled_allocator(cap, seed=n)
        slots = alloc.alloc(n)

        def ours() -> torch.Tensor:
            return runner.forward(ForwardBatch.build([prompt], [0], [slots])).next_token_logits

        ids = torch.tensor([prompt])

        def theirs() -> torch.Tensor:
            with torch.inference_mode():
                out = hf(input_ids=ids, past_key_values=DynamicCache(), logits_to_keep=1)
            return out.logits[0, -1].float()

        diff = (ours()[0] - theirs()).abs().max().item()  # also warms both up
        t_ours = t_hf = float("inf")
        for _ in range(args.reps):  # interleaved, best of reps
            t_ours = min(t_ours, _time(ours, 1))
            t_hf = min(t_hf, _time(theirs, 1))
        rows.append(dict(dtype=name, what=f"prefill {n}", ours=n / t_ours, hf=n / t_hf,
                         note=f"max abs logit diff vs HF {diff:.2e}"))
        print(f"  {rows[-1]}", file=sys.stderr)

    # ---------------- decode
    prompt = torch.randint(0, vocab, (CTX,), generator=gen).tolist()
    base_alloc = SlotAllocator(cap)
    ctx_slots = base_alloc.alloc(CTX)
    runner.forward(ForwardBatch.build([prompt], [0], [ctx_slots]))
    pool = runner.kv_pool
    with torch.inference_mode():
        hf_cache = DynamicCache()
        hf(input_ids=torch.tensor([prompt]), past_key_values=hf_cache, logits_to_keep=1)

    eager_backend = EagerTorchAttentionBackend()
    fused = runner.attn_backend.fused_decode if hasattr(runner.attn_backend, "fused_decode") \
        else False
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
                pool.kv, ctx_slots, b, dense_cap, fused=False)),
            "hf": hf_step,
        }
        if fused:
            contenders["contiguous fused"] = paged(SlotAllocator(cap), backend=DenseCacheBackend(
                pool.kv, ctx_slots, b, dense_cap, fused=True))
        best = {k: float("inf") for k in contenders}
        for i in range(args.steps + 1):
            for k, step in contenders.items():
                dt = _time(lambda: step(i), 1)
                if i > 0:  # step 0 is the warm-up
                    best[k] = min(best[k], dt)
        tps = {k: b / v for k, v in best.items()}
        shuffled, contig_slots, eager, hf_tps, served_tps = (
            tps["shuffled"], tps["ordered"], tps["eager"], tps["hf"], tps["served"])
        contiguous = max(tps["contiguous eager"], tps.get("contiguous fused", 0.0))
        dense_note = f"eager {tps['contiguous eager']:.1f}"
        if fused:
            dense_note = f"fused {tps['contiguous fused']:.1f}, " + dense_note
        del cache, contenders
        rows.append(dict(
            dtype=name, what=f"decode B={b} ctx {CTX}", ours=served_tps, hf=hf_tps,
            note=(f"paged/contiguous: served {served_tps / contiguous:.2f}, shuffled "
                  f"{shuffled / contiguous:.2f}, in-order {contig_slots / contiguous:.2f} "
                  f"(contiguous cache {contiguous:.1f} tok/s [{dense_note}]; shuffled "
                  f"{shuffled:.1f}, shuffled/HF {shuffled / hf_tps:.2f}; eager gather path "
                  f"on shuffled slots {eager:.1f})"),
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
        from radixserve.model.tiny import tiny_random_config, tiny_random_state_dict

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
          f"decode steps {args.steps}, prefill reps {args.reps}", file=sys.stderr)
    rows: list[dict] = []
    for dt in args.dtypes.split(","):
        rows += bench_dtype(config, sd32, getattr(torch, dt), args)

    print(f"\n### {model_name} forward throughput (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)\n")
    print("| dtype | workload | ours tok/s | transformers tok/s | ours / HF | notes |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['what']} | {r['ours']:.1f} | {r['hf']:.1f} | "
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
