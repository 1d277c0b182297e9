"""The engine core: token ids in, token ids out, one ``step()`` at a time.

``step()`` is the whole loop body — ``scheduler.schedule()`` → ``runner.run(batch)`` →
``scheduler.postprocess(batch, rows)`` — and the same object runs inside the engine-core
process (``engine/loop.py``), on a thread of the API process, or under the in-process
:class:`~radixserve.engine.engine.Engine`. It knows nothing of text: tokenization,
detokenization and stop strings belong to its callers (``engine/output.py``).

Faults stay local: bad input raises ``ValueError`` at ``add_request`` and changes nothing;
a request whose sampling fails ends alone with ``finish_reason="error"``; a forward pass
that raises fails the requests of that batch only (the waiting queue is untouched) and,
because their new slots were never marked written, none of that step's K/V reaches the
prefix cache.
"""

from __future__ import annotations

import atexit
import dataclasses
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from typing import Any, Callable

import torch

from radixserve.cache import make_cache
from radixserve.cache.swa import SWARadixCache
from radixserve.config import EngineConfig
from radixserve.core import Req, ReqStatus
from radixserve.engine.dtype_choice import choose_dtype
from radixserve.engine.messages import Load, ReqDelta
from radixserve.engine.runner import ModelRunner
from radixserve.images import ImageInput, expand_prompt
from radixserve.memory import SlotAllocator
from radixserve.memory.quant import kv_dtype_name, row_elems, storage_dtype
from radixserve.memory.swa import HybridAllocator, HybridKVPool
from radixserve.model.registry import LoadedModel, load_model
from radixserve.parallel import TPFailure
from radixserve.parallel.leader import TPLeader
from radixserve.parallel.rendezvous import default_threads
from radixserve.sampling_params import SamplingParams
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.sessions import check_session_id

log = logging.getLogger("radixserve.engine")

def resolve_dtype(name: str, device: str = "cpu", cpu_isa: str = "auto") -> torch.dtype:
    """The serving dtype for ``--dtype name`` on this machine (see :mod:`dtype_choice`)."""
    return choose_dtype(name, device, cpu_isa).dtype


def check_fits(prompt_len: int, max_tokens: int, max_context_len: int, kv_capacity: int,
               page_size: int) -> None:
    """ValueError unless a prompt of ``prompt_len`` tokens with ``max_tokens`` to generate
    fits the context window and can ever fit the KV pool (shared by the core and the API
    process, which checks before streaming starts)."""
    if prompt_len >= max_context_len:
        raise ValueError(f"prompt has {prompt_len} tokens; the context length is {max_context_len}")
    if prompt_len + max_tokens > max_context_len:
        raise ValueError(
            f"max_tokens ({max_tokens}) + prompt ({prompt_len} tokens) exceeds the "
            f"context length {max_context_len}")
    if prompt_len + 1 > kv_capacity - page_size:
        raise ValueError(
            f"prompt has {prompt_len} tokens; the KV pool holds {kv_capacity} (raise kv_cache_tokens)")


IDLE_WAIT_S = 0.002  # longest wait for background work when a step finds nothing to run


class EngineCore:
    """Scheduler + model runner + prefix cache behind a token-id interface."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 exit_on_tp_failure: bool = False):
        """``exit_on_tp_failure``: with ``tp_size > 1``, end the process when a rank fails
        (what the engine-core process wants); otherwise the next step raises TPFailure."""
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = cfg = config
        threads = default_threads(cfg)
        if threads:
            torch.set_num_threads(threads)  # process-wide, as torch offers it
        self.dtype_choice = choose_dtype(cfg.dtype, cfg.device, cfg.cpu_isa,
                                         loaded.config if loaded is not None else None)
        self.dtype = self.dtype_choice.dtype
        log.info("dtype %s (%s)", self.dtype_choice.name, self.dtype_choice.reason)
        self.loaded = loaded if loaded is not None else load_model(cfg.model, dtype=self.dtype)
        # "auto": the weights' dtype (a bfloat16 model keeps a bfloat16 cache).
        self.kv_dtype = kv_dtype_name(self.dtype) if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        mc = self.loaded.config
        self.model_config = mc
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = mc.vocab_size
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        self.tp: TPLeader | None = None
        if cfg.tp_size > 1:
            # Starts the other ranks; raises (ValueError, TPFailure) naming a rank that fails.
            self.tp = TPLeader(cfg, mc, self.dtype, exit_on_failure=exit_on_tp_failure)
        self.allocator = self._make_allocator(mc)
        try:
            if self.loaded.vision is not None and self.tp is not None:
                raise ValueError("tp_size > 1 is not supported for a vision-language model")
            self.runner = ModelRunner.from_config(
                mc, self.loaded.state_dict, kv_capacity=cfg.kv_cache_tokens, dtype=self.dtype,
                vision=self.loaded.vision, image_cache_bytes=cfg.image_cache_bytes,
                device=cfg.device, backend=cfg.attention_backend, tp=self.tp, cpu_isa=cfg.cpu_isa,
                linear_backend=cfg.linear_backend, kv_dtype=self.kv_dtype,
                swa_map=self.allocator.swa_map if isinstance(self.allocator, HybridAllocator) else None,
            )
            if self.tp is not None:
                self.tp.wait_ready(self.loaded.state_dict)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise
        self.cache = self._make_cache()
        self.eos_ids: tuple[int, ...] = tuple(self.tokenizer.stop_token_ids)
        self.scheduler = Scheduler(cfg, self.allocator, self.cache, self.max_context_len, self.eos_ids)
        self.requests: dict[str, Req] = {}
        self._pending: list[ReqDelta] = []  # finals of requests ended between steps
        #: Structured outputs: grammars compile on a thread pool (``self.grammars``, built on
        #: first use); a request waits here, outside the scheduler, until its grammar is ready.
        self._grammars: Any = None
        self._compiling: dict[str, tuple[Req, Any]] = {}
        self.step_hooks: list[Callable[[], None]] = []  # run after every step (event flush)
        self.started = time.monotonic()
        self.steps = 0
        self._counter = 0
        self._closed = False
        if cfg.hicache_storage or self.tp is not None:
            atexit.register(self._close_at_exit)

    def _make_allocator(self, mc) -> SlotAllocator:  # noqa: ANN001
        """Slots of the KV pool; for a model with sliding-window and full-attention layers, a
        pool per kind (a full-attention layout would spend the sliding layers' bytes on
        tokens no window reads)."""
        cfg = self.config
        windows = {mc.layer_window(i) for i in range(mc.num_layers)}
        if windows == {0} or 0 not in windows or not cfg.hybrid_kv:
            return SlotAllocator(cfg.kv_cache_tokens, cfg.page_size)
        for bad, why in ((cfg.cache == "table", "cache='table' (a table cannot tell which window KV is left)"),
                         (cfg.hicache_l2_tokens > 0, "hicache_l2_tokens > 0 (HiCache tiers do not carry "
                                                     "sliding-window KV yet)"),
                         (cfg.tp_size > 1, "tp_size > 1")):
            if bad:
                raise ValueError(f"model {cfg.model!r} has sliding-window layers; not supported with {why}")
        # Auto: room for every running request's window (and one more) and a prefill chunk,
        # at least a quarter of the full pool.
        need = (cfg.max_running_requests + 1) * (mc.sliding_window + cfg.page_size) + cfg.chunked_prefill_size
        swa = cfg.swa_kv_cache_tokens or min(cfg.kv_cache_tokens, max(cfg.kv_cache_tokens // 4, need))
        alloc = HybridAllocator(cfg.kv_cache_tokens, swa, cfg.page_size, window=mc.sliding_window)
        n_swa = sum(1 for i in range(mc.num_layers) if mc.layer_window(i))
        per_tok = 2 * mc.num_kv_heads * row_elems(self.kv_dtype, mc.head_dim) * storage_dtype(self.kv_dtype).itemsize
        nbytes = per_tok * ((mc.num_layers - n_swa) * alloc.capacity + n_swa * alloc.swa.capacity)
        full_layout = nbytes // (per_tok * mc.num_layers)
        log.info("hybrid KV: %d full-attention tokens (%d layers) + %d sliding-window tokens (%d layers, "
                 "window %d) in %.1f MiB; a full-attention layout holds %d tokens in as much memory, "
                 "this one %.2fx as many", alloc.capacity, mc.num_layers - n_swa, alloc.swa.capacity, n_swa,
                 mc.sliding_window, nbytes / 2**20, full_layout, alloc.capacity / max(1, full_layout))
        return alloc

    def _make_cache(self):  # noqa: ANN202
        cfg = self.config
        if isinstance(self.allocator, HybridAllocator):
            if cfg.cache == "radix":
                return SWARadixCache(self.allocator, self.allocator.window)
            return make_cache(cfg.cache, page_size=cfg.page_size, on_free=self.allocator.free)
        if not cfg.hicache_l2_tokens:
            return make_cache(cfg.cache, page_size=cfg.page_size, on_free=self.allocator.free)
        from radixserve.cache.hicache import HiCacheConfig, HiRadixCache

        cache = HiRadixCache.from_config(HiCacheConfig.from_engine(cfg), self.allocator, self.runner.kv_pool)
        cache.on_written = self.allocator.mark_written  # L2 -> L1 loads hold K/V
        return cache

    def close(self) -> None:
        """Stop background work (storage threads, tensor-parallel ranks); the core cannot
        step afterwards. Idempotent; also run at interpreter exit for a core with
        background threads that was never closed (see ``_close_at_exit``)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        if self._grammars is not None:
            self._grammars.close()
        self.cache.close()
        if self.tp is not None:
            self.tp.shutdown()

    def _close_at_exit(self) -> None:
        # Storage threads that call into torch while the interpreter finalizes end the
        # process with std::terminate; stop them first.
        self.close()

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The request as the core will run it, or ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not all(
                type(t) is int for t in prompt_ids):
            raise ValueError("prompt token ids must be a list of integers")
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt must not be empty")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        check_fits(len(ids), params.max_tokens, self.max_context_len, self.allocator.capacity,
                   self.config.page_size)
        return ids

    def add_request(self, rid: str, prompt_ids: Sequence[int], params: SamplingParams,
                    salt: str | None = None, arrival: float | None = None,
                    session_id: str | None = None, images: Sequence[ImageInput] | None = None) -> None:
        """Queue a request. Raises ValueError on bad input, changing nothing. With a
        ``session_id`` its cached tokens are kept for the session's next turn
        (``sched/sessions.py``). ``images``: for a vision-language model, one per image
        placeholder token of the prompt, in order (``radixserve.images``)."""
        if not isinstance(rid, str) or not rid:
            raise ValueError("request id must be a non-empty string")
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a string or None, got {type(salt).__name__}")
        check_session_id(session_id)
        prompt_ids, spans, imgs = self._expand_images(rid, prompt_ids, images)
        ids = self.validate(prompt_ids, params)
        req = Req(rid=rid, prompt_ids=ids, params=params, salt=salt, session_id=session_id,
                  images=imgs, image_spans=spans)
        if arrival:
            req.arrival = arrival
        spec = params.grammar
        if not params.is_greedy:
            # Unseeded requests still get their own generator, seeded from the engine's seed
            # and arrival order: runs are reproducible and independent of batch composition.
            seed = params.seed if params.seed is not None else (self.config.seed + self._counter) % 2**64
            self._counter += 1
            req.generator = self.runner.sampler.make_generator(seed)
        self.requests[rid] = req
        if spec is None:
            self.scheduler.add(req)
            return
        fut = self.grammars.submit(spec)
        if fut.done() and fut.exception() is None:
            req.grammar = fut.result().new_state()
            self.scheduler.add(req)
        else:
            self._compiling[rid] = (req, fut)

    def _expand_images(self, rid: str, prompt_ids: Sequence[int], images: Sequence[ImageInput] | None):  # noqa: ANN202
        """(prompt with each image placeholder expanded, image spans, images); ValueError for
        images on a text model, a placeholder count that differs from the images', or an
        image the vision tower cannot read."""
        vision = self.loaded.vision
        if vision is None:
            if images:
                raise ValueError(f"images: model {self.config.model!r} does not accept images")
            return prompt_ids, (), ()
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        images = list(images or ())
        vc = vision.config
        size = vc.vision.image_size
        for i, im in enumerate(images):
            if not isinstance(im, ImageInput):
                raise ValueError(f"images[{i}] must be an ImageInput, got {type(im).__name__}")
            if tuple(im.pixel_values.shape) != (3, size, size):
                raise ValueError(f"images[{i}]: pixel_values must be [3, {size}, {size}] for this model, "
                                 f"got {list(im.pixel_values.shape)}")
        # Without content keys every request's images are its own: never shared.
        keys = [im.digest if self.config.image_content_keys else f"{im.digest}:{rid}" for im in images]
        if not isinstance(prompt_ids, (list, tuple)):
            raise ValueError("prompt token ids must be a list of integers")
        ids, spans = expand_prompt(prompt_ids, vc.image_token_id, vc.tokens_per_image, keys)
        return ids, spans, tuple(images)

    @property
    def grammars(self):  # noqa: ANN201 - GrammarCompiler, imported on first use
        """The grammar compiler of this model's vocabulary (``radixserve.grammar``)."""
        if self._grammars is None:
            from radixserve.grammar.compiler import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached), raising GrammarError (a ValueError)
        naming the field if it cannot be used: for callers that must refuse a request before
        it is queued (the in-process ``Engine``; the server does it in its own process)."""
        spec = params.grammar
        if spec is not None:
            self.grammars.compile(spec)

    def _admit_compiled(self, out: list[ReqDelta]) -> None:
        """Requests whose grammar finished compiling join the scheduler's queue; one whose
        grammar failed ends alone with its error."""
        for rid, (req, fut) in list(self._compiling.items()):
            if not fut.done():
                continue
            del self._compiling[rid]
            err = fut.exception()
            if err is None:
                req.grammar = fut.result().new_state()
                self.scheduler.add(req)
                continue
            self.requests.pop(rid, None)
            req.status = ReqStatus.FINISHED
            req.finish_reason = "error"
            req.error = str(err) if isinstance(err, ValueError) else f"grammar: {type(err).__name__}: {err}"
            req.finish_time = time.monotonic()
            out.append(self._delta(req, [], None, None))

    def _grammar_constraints(self, batch: Any) -> dict[str, Any] | None:
        """What each grammar row of this step may produce, by request id: the forced token, or
        a bitmask of the allowed ones. Rows without a grammar get nothing (never masked)."""
        rows = [r for r, smp in zip(batch.reqs, batch.sample)
                if smp and r.grammar is not None and r.params.max_tokens > len(r.output_ids)]
        if not rows:
            return None
        from radixserve.engine.sampler import RowConstraint
        from radixserve.grammar.mask import allocate_bitmask

        bound: dict[str, RowConstraint] = {}
        need_mask: list[Req] = []
        for r in rows:
            t = r.grammar.forced_token()
            if t is not None:
                bound[r.rid] = RowConstraint(forced=t)
            else:
                need_mask.append(r)
        if need_mask:
            bm = allocate_bitmask(len(need_mask), self.vocab_size)
            for j, r in enumerate(need_mask):
                r.grammar.fill_mask(bm, j)
                bound[r.rid] = RowConstraint(bitmask=bm[j])
        return bound

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> bool:
        """End a request now; its slots and locks are released at once and its final delta
        comes with the next step's outputs. False if there is no such running request."""
        req = self.requests.pop(rid, None)
        if req is None or req.finished:
            return False
        if self._compiling.pop(rid, None) is not None:  # never reached the scheduler
            req.status = ReqStatus.FINISHED
            req.finish_reason, req.error, req.finish_time = reason, error, time.monotonic()
            self._pending.append(self._delta(req, [], None, None))
            return True
        self.scheduler.finish(req, reason, error)
        self._pending.append(self._delta(req, [], None, None))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or bool(self._compiling)

    # ------------------------------------------------------------------ the loop body
    def step(self) -> list[ReqDelta]:
        """Run one scheduled batch; return a delta for every request that advanced or ended."""
        out, self._pending = self._pending, []
        if self._compiling:
            self._admit_compiled(out)
        sched = self.scheduler.schedule()
        for req in sched.failed:
            self._ended(req, out)
        batch = sched.batch
        if batch is None and not sched.failed and self._compiling and not self.scheduler.waiting:
            # Only grammars are being compiled: wait for one instead of spinning.
            concurrent.futures.wait([f for _, f in self._compiling.values()], IDLE_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        elif batch is None and not sched.failed and self.scheduler.waiting:
            # Nothing could run (e.g. prefixes still coming from storage): wait for the
            # background work instead of spinning the caller's loop.
            self.cache.wait_background(IDLE_WAIT_S)
        if batch is not None:
            self.steps += 1
            before = [len(r.output_ids) for r in batch.reqs]
            try:
                result = self.runner.run(batch, self._grammar_constraints(batch))
            except TPFailure:  # the ranks are out of step: the engine cannot go on
                raise
            except Exception as e:  # a fault no single request explains: this batch fails
                log.exception("forward pass failed; failing the %d request(s) of its batch",
                              len(batch.reqs))
                for req in self.scheduler.fail_batch(batch, f"engine step failed: {type(e).__name__}: {e}"):
                    self._ended(req, out)
            else:
                self.scheduler.postprocess(batch, result.rows)
                for i, req in enumerate(batch.reqs):
                    plp = result.prompt_logprobs[i]
                    if plp is not None:
                        req.prompt_logprobs.extend(plp[0])
                        req.prompt_top_logprobs.extend(plp[1])
                    new = req.output_ids[before[i]:]
                    row = result.rows[i]
                    if new or req.finished:
                        lp = [row.logprob] if new and row is not None and req.params.wants_logprobs else None
                        tlp = [row.top_logprobs or []] if new and row is not None and req.params.top_logprobs else None
                        if lp is not None and lp[0] is None:
                            lp = [0.0]
                        out.append(self._delta(req, new, lp, tlp))
                        if req.finished:
                            self.requests.pop(req.rid, None)
        for hook in self.step_hooks:
            hook()
        return out

    def _ended(self, req: Req, out: list[ReqDelta]) -> None:
        self.requests.pop(req.rid, None)
        out.append(self._delta(req, [], None, None))

    def _delta(self, req: Req, new: list[int], lps: list[float] | None,
               tops: list[list[tuple[int, float]]] | None) -> ReqDelta:
        d = ReqDelta(req.rid, new, max(0, req.cached_tokens))
        if lps is not None:
            d.logprobs = lps
        if tops is not None:
            d.top_logprobs = tops
        if req.first_token_time is not None and (new and len(req.output_ids) == len(new)):
            d.first_token_time = req.first_token_time
        if req.tier_report is not None:
            d.cached_by_tier = req.tier_report.get("cached")
            d.uncached_by_reason = req.tier_report.get("uncached")
            req.tier_report = None  # sent once
        if req.logprob_start >= 0 and not req.prompt_logprobs_sent and (req.output_ids or req.finished):
            d.prompt_logprobs = req.prompt_logprobs
            d.prompt_top_logprobs = req.prompt_top_logprobs
            req.prompt_logprobs_sent = True
        if req.finished:
            d.finished = True
            d.finish_reason = req.finish_reason
            d.matched_stop = req.matched_stop
            d.error = req.error
            d.finish_time = req.finish_time
            if req.first_token_time is not None:
                d.first_token_time = req.first_token_time
        return d

    # ------------------------------------------------------------------ utilities
    def load(self) -> Load:
        s = self.scheduler
        return Load(s.num_unfinished - len(s.waiting), len(s.waiting), self.allocator.available)

    def stats(self) -> dict[str, Any]:
        sch = self.scheduler
        s = sch.stats
        cap = self.allocator.capacity
        free = self.allocator.available
        running = sch.running + ([sch.chunked] if sch.chunked else [])
        private = sum(r.computed_len - r.prefix_len + int(r.spare_slots.numel()) for r in running)
        q = s.prefix_query_tokens
        return {
            "prefix_cache_query_tokens": q,
            "prefix_cache_hit_tokens": s.prefix_hit_tokens,
            "prefix_cache_hit_rate": (s.prefix_hit_tokens / q) if q else 0.0,
            "computed_prefill_tokens": s.computed_prefill_tokens,
            "generated_tokens": s.generated_tokens,
            "image_query_tokens": s.image_query_tokens,
            "cached_image_tokens": s.image_hit_tokens,
            **self.runner.image_stats(),
            "grammar_forced_tokens": s.forced_tokens,
            "grammars_compiled": self._grammars.compiled if self._grammars is not None else 0,
            "grammar_compile_seconds": self._grammars.compile_seconds if self._grammars is not None else 0.0,
            "running_requests": len(running),
            "waiting_requests": len(sch.waiting),
            "kv_capacity_tokens": cap,
            "kv_free_tokens": free,
            "kv_used_tokens": cap - free - self.cache.evictable_size,
            "kv_usage": (cap - free) / cap,
            "cached_tokens": self.cache.total_size,
            "evictable_tokens": self.cache.evictable_size,
            "protected_tokens": self.cache.protected_size,
            "private_tokens": private,
            "evicted_tokens": self.cache.evicted_tokens,
            "retractions": s.retractions,
            "finished_requests": s.finished_requests,
            "aborted_requests": s.aborted_requests,
            "failed_requests": s.failed_requests,
            "failed_steps": s.failed_steps,
            "prefill_steps": s.prefill_steps,
            "decode_steps": s.decode_steps,
            "mixed_steps": s.mixed_steps,
            "max_wait_seconds": s.max_wait_seconds,
            "tree_seconds": s.tree_seconds,
            "forward_seconds": self.runner.forward_seconds,
            "steps": self.steps,
            "dtype": self.dtype_choice.name,
            "dtype_reason": self.dtype_choice.reason,
            "kv_cache_dtype": self.kv_dtype,
            "kv_bytes_per_token": self.runner.kv_pool.bytes_per_token,
            **sch.sessions.stats(),
            **self.runner.kernel_info(),
            **({"hicache": self.cache.stats()} if self.config.hicache_l2_tokens else {}),
            **({"tp": self.tp.stats()} if self.tp is not None else {}),
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests are in flight."""
        return self.scheduler.flush_cache()

    def check_integrity(self) -> dict[str, Any]:
        """Raise AssertionError if an invariant is broken; returns the stats checked against."""
        self.scheduler.check_integrity()
        self._check_kv_scales()
        live = {r.rid for r in self.scheduler.all_reqs()} | set(self._compiling)
        if live != set(self.requests):
            raise AssertionError(f"request table out of sync: {sorted(live ^ set(self.requests))[:5]}")
        stats = self.stats()
        if self.tp is not None:
            stats["tp_check"] = self.tp.check()  # every rank used the same slots, step by step
        return stats

    def _check_kv_scales(self) -> None:
        """A quantized pool: every slot holding written K/V has valid scales (in each pool of
        a hybrid model: a sliding-window slot through the full slot it serves)."""
        pool = self.runner.kv_pool
        if not pool.quantized:
            return
        written = self.allocator.written.nonzero().reshape(-1)
        if isinstance(pool, HybridKVPool):
            pool.full.check_scales(written)
            swa = pool.swa_map[written]
            pool.swa.check_scales(swa[swa >= 0])
        else:
            pool.check_scales(written)

    def model_info(self) -> dict[str, Any]:
        """What the API side needs to know about the model (sent once at startup)."""
        mc = self.model_config
        return {
            "model": self.config.model,
            "arch": getattr(mc, "arch", None),
            "vocab_size": self.vocab_size,
            "max_context_len": self.max_context_len,
            "eos_ids": list(self.eos_ids),
            "kv_capacity_tokens": self.allocator.capacity,
            "max_running_requests": self.config.max_running_requests,
            "page_size": self.config.page_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.kv_dtype,
            "tp_size": self.config.tp_size,
            "vision": self._vision_info(),
        }

    def _vision_info(self) -> dict[str, Any] | None:
        """What the API side needs to turn images into :class:`ImageInput` (None: text model)."""
        vision = self.loaded.vision
        if vision is None:
            return None
        return {"image_token_id": vision.config.image_token_id,
                "tokens_per_image": vision.config.tokens_per_image,
                "processor": dataclasses.asdict(vision.processor)}

    UTILITIES = ("stats", "flush_cache", "check_integrity", "model_info", "health", "open_session",
                 "close_session")

    def open_session(self, session_id: str, ttl_s: float | None = None) -> bool:
        """Open a session with its own TTL (``ttl_s``; requests open theirs implicitly);
        False if it is open already, ValueError if sessions are off or the id is bad."""
        return self.scheduler.open_session(session_id, ttl_s)

    def close_session(self, session_id: str) -> bool:
        """End a session: the KV it keeps is released now. False if it was not open."""
        check_session_id(session_id)
        return self.scheduler.close_session(session_id)

    def health(self) -> bool:
        if self.tp is not None and not self.tp.alive():
            raise TPFailure(self.tp.failure or "the tensor-parallel group was shut down")
        return True

    def call(self, method: str, args: dict[str, Any] | None = None) -> Any:
        """Run a named utility (what the API side may ask over the wire)."""
        if method not in self.UTILITIES:
            raise ValueError(f"unknown engine call {method!r}")
        return getattr(self, method)(**(args or {}))
