"""ModelRunner: turns a scheduled batch into model input, runs it, samples the next tokens.

The scheduler decides *what* runs (requests, token counts, KV slots); the runner owns *how*:
``prepare(batch)`` builds the :class:`ForwardBatch` (token ids, positions, slot indices) the
model reads, ``run(batch)`` runs the forward under ``inference_mode`` and the sampler, and
computes the prompt logprobs asked for. The scheduler therefore never imports the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from radixserve.request import Req
from radixserve.engine.sampler import RowConstraint, Sampler
from radixserve.engine.verify import DraftVerifier, sampled_row
from radixserve.memory.kv_pool import KVPool
from radixserve.memory.mamba import MambaStatePool
from radixserve.memory.swa_pool import HybridKVPool
from radixserve.model.arch.attention import make_attention_backend
from radixserve.model.arch.attention_base import AttentionBackend
from radixserve.model.model_config import ModelConfig
from radixserve.engine.image_feed import ImageFeeder
from radixserve.model.arch.factory import create_model, create_vlm
from radixserve.model.arch.forward_batch import ForwardBatch, ForwardOutput
from radixserve.model.arch.llama import LlamaForCausalLM
from radixserve.model.arch.llava import LlavaForConditionalGeneration
from radixserve.model.vision.vlm_config import VisionParts
from radixserve.parallel.leader import TPLeader
from radixserve.sched.batch import SampledRow, ScheduledBatch

PromptLogprobs = tuple[list[tuple[int, float | None]], list[list[tuple[int, float]]]]


@dataclass
class StepResult:
    """Per request of the batch: the sampled row (None when nothing was sampled) and the
    prompt logprobs this chunk produced (None when not asked for). A row with a draft has
    ``verified[i]`` instead: the sampled rows of its positions up to the first that is not
    the draft's token (``engine/verify.py``), and ``rows[i]`` is the last of them."""

    rows: list[SampledRow | None]
    prompt_logprobs: list[PromptLogprobs | None]
    verified: list[list[SampledRow] | None] | None = None

    def rows_of(self, i: int) -> list[SampledRow]:
        """Every sampled row of request ``i`` this step, in token order."""
        if self.verified is not None and self.verified[i] is not None:
            return self.verified[i]
        row = self.rows[i]
        return [row] if row is not None else []


class ModelRunner:
    """Runs forward passes and sampling; counts time and tokens: prefill, decode (a running
    request's own tokens) and draft (speculative decoding's positions after them, which an
    extend computes like prefill but which are not prompt work)."""

    def __init__(self, model: LlamaForCausalLM, kv_pool: KVPool, attn_backend: AttentionBackend,
                 sampler: Sampler | None = None, tp: TPLeader | None = None,
                 vlm: LlavaForConditionalGeneration | None = None, image_cache_bytes: int = 0):
        self.model = model
        # A vision-language model: ``model`` is its decoder; ``vlm`` encodes the images, whose
        # features replace the embeddings at image positions (``ImageFeeder``).
        self.images = ImageFeeder(vlm, image_cache_bytes) if vlm is not None else None
        self.tp = tp  # tensor parallelism: every forward goes to all ranks through rank 0
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.config = model.config
        self.device = model.device
        self.sampler = sampler or Sampler(model.config.vocab_size, device=model.device)
        self.verifier = DraftVerifier(self.sampler)
        self.forward_seconds = 0.0
        self.forward_calls = self.prefill_tokens = self.decode_tokens = self.draft_tokens = 0

    @classmethod
    def from_config(cls, config: ModelConfig, state_dict: Mapping[str, torch.Tensor], kv_capacity: int,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", backend: str = "torch",
                    kv_dtype: torch.dtype | str | None = None, pack_weights: bool | None = None,
                    tp: TPLeader | None = None, cpu_isa: str = "auto", linear_backend: str = "auto",
                    swa_map: torch.Tensor | None = None, vision: VisionParts | None = None,
                    image_cache_bytes: int = 0, states: MambaStatePool | None = None) -> "ModelRunner":
        """Build model (weights in ``dtype``), a KV pool of ``kv_capacity`` slots and a backend.

        ``kv_dtype`` (a torch float dtype or a KV kind name: ``radixserve.memory.quant``)
        defaults to ``dtype``: a bfloat16 model keeps a bfloat16 cache; int8 / fp8_e4m3 pools
        keep one scale per token and KV head in each slot. ``pack_weights``: see
        :meth:`LlamaForCausalLM.from_state_dict` (None = oneDNN-packed linears where supported).
        ``tp``: rank 0 of a tensor-parallel group; the model and the pool are then its shard.
        ``cpu_isa``: the instruction-set cap of the CPU kernels and weight packing
        (``radixserve.kernels.isa``); ``linear_backend``: see :mod:`radixserve.kernels.linear`.
        ``swa_map``: a hybrid model's full -> SWA slot map (``HybridAllocator.swa_map``); its
        sliding-window layers then get a pool of their own, of the allocator's SWA capacity.
        ``vision``: a vision-language model's tower and projector (``LoadedModel.vision``);
        ``image_cache_bytes`` bounds the LRU of their outputs. ``states``: a hybrid Mamba model's
        state pool (``radixserve.model.arch.bamba.make_state_pool``), which its Mamba layers read and
        write; the KV pool then holds the attention layers only."""
        if kv_capacity < 1:
            raise ValueError(f"kv_capacity must be >= 1, got {kv_capacity}")
        build = dict(dtype=dtype, device=device, pack_weights=pack_weights, cpu_isa=cpu_isa,
                     linear_backend=linear_backend)
        vlm = None
        if vision is not None:
            if tp is not None:
                raise ValueError("tensor parallelism does not serve vision-language models")
            vlm = create_vlm(config, state_dict, vision, **build)
            model = vlm.language_model
        elif tp is not None:
            model = tp.build_model(state_dict, pack_weights=pack_weights)
        else:
            model = create_model(config, state_dict, **build)
        pool = cls._kv_pool(config, model.config.num_kv_heads, kv_capacity, kv_dtype or dtype, device, swa_map)
        if config.mamba_layers:
            if states is None:
                raise ValueError(f"model arch {config.arch!r} has Mamba layers: it needs a state pool (states)")
            model.bind_states(states)
        return cls(model, pool, make_attention_backend(backend, model.device, cpu_isa), tp=tp, vlm=vlm,
                   image_cache_bytes=image_cache_bytes)

    @staticmethod
    def _kv_pool(config: ModelConfig, num_kv_heads: int, capacity: int, dtype: torch.dtype | str,
                 device: str | torch.device, swa_map: torch.Tensor | None) -> KVPool | HybridKVPool:
        """The attention layers' KV pool (``num_kv_heads``: this rank's); with ``swa_map`` a
        hybrid pool whose sliding-window layers hold the allocator's SWA capacity."""
        if swa_map is not None:
            return HybridKVPool([config.layer_window(i) for i in range(config.num_layers)], capacity,
                                int(swa_map[capacity]), num_kv_heads, config.head_dim, swa_map, dtype, device)
        return KVPool(num_layers=len(config.attention_layers), capacity=capacity, num_kv_heads=num_kv_heads,
                      head_dim=config.head_dim, dtype=dtype, device=device)

    def batch_invariance_gap(self) -> str | None:
        """Why a row's logits may depend on its batch here (speculation needs them not to), or None."""
        if not self.model.linears.batch_invariant:
            return f"linear backend {self.model.linears.backend!r} is not batch-invariant"
        if not getattr(self.attn_backend, "uses_kernels", False):
            return "the attention kernels are not in use (the eager path is not batch-invariant)"
        return None

    def kernel_info(self) -> dict[str, str | bool]:
        """Which code paths serve this model on this CPU (for stats and /server_info)."""
        from radixserve.kernels.isa import describe
        from radixserve.kernels.library import IMPL_NAMES

        backend = self.attn_backend
        lin = self.model.linears
        info = {"cpu": describe(), "attention_backend": getattr(backend, "name", type(backend).__name__),
                "linear": lin.backend, "linear_reason": lin.why, "batch_invariant": lin.batch_invariant,
                "linear_weights": str(self.model.dtype).removeprefix("torch."), "weights": self.weights_info(),
                "activations": str(lin.act_dtype).removeprefix("torch.")}
        impl_for = getattr(backend, "impl_for", None)
        if impl_for is not None and getattr(backend, "uses_kernels", False):
            impl = impl_for(self.kv_pool.dtype, self.config.head_dim)
            info["cpu_isa"] = backend.kernels.isa
            info["attention_impl"] = IMPL_NAMES.get(impl, str(impl))
        else:
            info["attention_impl"] = "eager torch"
        return info

    def weights_info(self) -> str:
        """How the linear weights are held and computed, in words."""
        formats = self.model.weight_formats()
        dt = str(self.model.dtype).removeprefix("torch.")
        if not formats:
            return f"dense {dt}"
        expanded = [f for f in formats if "/" not in f]
        if len(expanded) == len(formats):
            return (f"quantized blocks ({', '.join(formats)}) expanded to the dense {dt} model's weights "
                    f"(the same bits)")
        how = []
        if any(f.endswith("/q8") for f in formats):
            how.append("/q8: integer dot products against activations quantized to 8 bits per 32-block "
                       "(csrc/gemm_q8dot.cpp's definition, batch-invariant)")
        if any(f.endswith("/codes") for f in formats):
            how.append("/codes: bfloat16 dot products on the block codes, the scale per block "
                       "(csrc/gemm_codes.cpp's definition, batch-invariant)")
        return (f"quantized blocks ({', '.join(formats)}); " + "; ".join(how)
                + (f"; the others expanded to the dense {dt} model's weights" if expanded else ""))

    # ------------------------------------------------------------------ model input
    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        token_ids = [r.tokens(s, s + e) for r, s, e in zip(batch.reqs, batch.starts, batch.extend_lens)]
        want_all = batch.want_all_logits
        if batch.drafts:  # a draft's tokens follow the row's own; every position gets logits
            for i, d in enumerate(batch.drafts):
                if d:
                    s, e = batch.starts[i], batch.extend_lens[i]
                    token_ids[i] = batch.reqs[i].tokens(s, s + e - len(d)) + d
            want_all = [w or bool(d) for w, d in zip(want_all, batch.drafts)]
        fb = ForwardBatch.build(token_ids=token_ids, prefix_lens=batch.starts,
                                seq_slots=[r.kv_slots for r in batch.reqs], return_all_logits=want_all,
                                device=self.device)
        fb.state_slots = [r.state_slot for r in batch.reqs]
        if batch.drafts:  # a Mamba state is settled after verification (MambaStatePool.settle)
            fb.state_staged = [bool(d) for d in batch.drafts]
        if self.images is not None:
            fb = self.images.feed(fb, batch)
        return fb

    def image_stats(self) -> dict[str, float]:
        return self.images.stats() if self.images is not None else {}

    def forward(self, fb: ForwardBatch, counts: tuple[int, int, int] | None = None) -> ForwardOutput:
        """Run the model on ``fb``. ``counts``: its (prefill, decode, draft) tokens as the
        scheduled batch knows them; without, an all-decode batch counts as decode and any
        other as prefill."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.tp is not None:
                out = self.tp.forward(self.model, fb, self.kv_pool, self.attn_backend)
            else:
                out = self.model.forward(fb, self.kv_pool, self.attn_backend)
        if self.device.type == "cuda":
            # Honest timing: kernels are async; the sampler would wait for them anyway.
            torch.cuda.synchronize(self.device)
        self.forward_seconds += time.perf_counter() - t0
        self.forward_calls += 1
        if counts is None:
            n = int(fb.input_ids.numel())
            counts = (0, n, 0) if fb.is_decode else (n, 0, 0)
        self.prefill_tokens += counts[0]
        self.decode_tokens += counts[1]
        self.draft_tokens += counts[2]
        return out

    @staticmethod
    def token_counts(batch: ScheduledBatch) -> tuple[int, int, int]:
        """(prefill, decode, draft) tokens of a scheduled batch: its first ``num_decode`` rows
        are running requests (their own tokens: the last sampled one and any forced ones),
        the rest prefill chunks; draft positions are counted apart."""
        drafted = sum(len(d) for d in batch.drafts)
        decode = sum(batch.extend_lens[: batch.num_decode]) - drafted
        return sum(batch.extend_lens[batch.num_decode :]), decode, drafted

    # ------------------------------------------------------------------ one step
    def run(self, batch: ScheduledBatch, constraints: dict[str, RowConstraint] | None = None,
            draft_constraints: Mapping[str, list[RowConstraint]] | None = None) -> StepResult:
        """Forward + sampling for one scheduled batch (raises if the forward fails).

        ``constraints``: structured-output rows of this step by request id (the grammar's
        forced token or allowed-token mask); every other row samples unconstrained.
        ``draft_constraints``: those of grammar rows verifying a draft, one per position
        (fewer than the draft's: only that many positions are verified)."""
        out = self.forward(self.prepare(batch), self.token_counts(batch))
        rows: list[SampledRow | None] = [None] * len(batch.reqs)
        verified = self._verify_drafts(batch, out, draft_constraints, rows) if batch.drafts else None
        self._sample(batch, out, constraints, rows)
        return StepResult(rows, self._chunk_logprobs(batch, out), verified)

    def _chunk_logprobs(self, batch: ScheduledBatch, out: ForwardOutput) -> list[PromptLogprobs | None]:
        """The prompt logprobs of each row that asked for every position's logits."""
        plps: list[PromptLogprobs | None] = [None] * len(batch.reqs)
        if any(batch.want_all_logits):
            for i, req in enumerate(batch.reqs):
                logits = out.all_logits[i] if out.all_logits and batch.want_all_logits[i] else None
                if logits is not None:
                    plps[i] = self._prompt_logprobs(req, batch.starts[i], batch.extend_lens[i], logits)
        return plps

    def _verify_drafts(self, batch: ScheduledBatch, out: ForwardOutput,
                       draft_constraints: Mapping[str, list[RowConstraint]] | None,
                       rows: list[SampledRow | None]) -> list[list[SampledRow] | None]:
        """Verify each row's draft; ``rows[i]`` becomes the last of row ``i``'s verified rows."""
        verified: list[list[SampledRow] | None] = [None] * len(batch.reqs)
        for i, d in enumerate(batch.drafts):
            if d:
                req = batch.reqs[i]
                # The draft's positions are the row's last: forced tokens fast-forwarded
                # before them (a grammar's) are computed, never sampled.
                logits = out.all_logits[i][-len(d) - 1 :]
                cons = draft_constraints.get(req.rid) if draft_constraints else None
                if cons is not None and len(cons) <= len(d):
                    d, logits = d[: len(cons) - 1], logits[: len(cons)]
                got = verified[i] = self.verifier.verify(req, d, logits, cons)
                rows[i] = got[-1]
        return verified

    def _sample(self, batch: ScheduledBatch, out: ForwardOutput,
                constraints: dict[str, RowConstraint] | None, rows: list[SampledRow | None]) -> None:
        """Sample the next token of every row that samples one and has no draft, into ``rows``."""
        reqs = batch.reqs
        idx = [i for i, s in enumerate(batch.sample)
               if s and reqs[i].params.max_tokens > len(reqs[i].output_ids) and not batch.draft(i)]
        if not idx:
            return
        sel = [reqs[i] for i in idx]
        logits = out.next_token_logits if len(idx) == len(reqs) else out.next_token_logits[idx]
        rows_c = None
        if constraints:
            rows_c = [constraints.get(r.rid) for r in sel]
            if sum(c is not None for c in rows_c) != len(constraints):
                raise RuntimeError("a grammar constraint was given for a request this step does not sample")
        so = self.sampler.sample(logits, [r.params for r in sel], [r.output_ids for r in sel],
                                 [r.prompt_ids for r in sel], [r.generator for r in sel], rows_c)
        for j, i in enumerate(idx):
            rows[i] = sampled_row(so, j)

    def _prompt_logprobs(self, req: Req, s: int, c: int, logits: torch.Tensor) -> PromptLogprobs:
        """Logprobs of the prompt tokens this chunk's logits predict (row j, at position
        ``s + j``, predicts the token at ``s + j + 1``)."""
        start = req.logprob_start
        prompt = req.prompt_ids
        chosen_out: list[tuple[int, float | None]] = []
        tops_out: list[list[tuple[int, float]]] = []
        if start == 0 and s == 0:
            chosen_out.append((prompt[0], None))
            tops_out.append([])
        first_q = max(start, 1, s + 1)
        last_q = min(len(prompt) - 1, s + c)
        if first_q <= last_q:
            rows = torch.arange(first_q - 1 - s, last_q - s)
            targets = torch.tensor(prompt[first_q : last_q + 1], dtype=torch.int64)
            tl = self.sampler.logprobs_of(logits[rows], targets, req.params.top_logprobs)
            chosen_out += zip(prompt[first_q : last_q + 1], tl.chosen.tolist())
            tops_out += [list(zip(ids, lps)) for ids, lps in zip(tl.top_ids.tolist(), tl.top_logprobs.tolist())]
        return chosen_out, tops_out
