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

import ctypes
import ctypes.util
import dataclasses
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch

from radixserve.cache.base import check_low_priority_from
from radixserve.config import EngineConfig
from radixserve.request import Req, ReqImages
from radixserve.kernels.dtype_choice import choose_dtype
from radixserve.engine.grammar_gate import GrammarGate
from radixserve.engine.image_intake import expand_images, vision_info
from radixserve.engine.kv_setup import make_allocator, make_prefix_cache, make_state_pool
from radixserve.engine.deltas import delta_of, sampled_delta
from radixserve.engine.limits import check_fits
from radixserve.engine.messages import Load, ModelInfo, ReqDelta, VisionSpec
from radixserve.engine.runner import ModelRunner
from radixserve.images import ImageInput
from radixserve.memory.quant import kv_dtype_name
from radixserve.memory.swa_pool import HybridAllocator
from radixserve.kernels.library import try_load_kernels
from radixserve.kernels.weight_choice import WeightChoice, choose_weights
from radixserve.model.registry import LoadedModel, is_gguf_source, load_model
from radixserve.parallel import TPFailure
from radixserve.parallel.leader import TPLeader
from radixserve.parallel.rendezvous import default_threads
from radixserve.engine.threads import ThreadGovernor
from radixserve.sampling_params import SamplingParams
from radixserve.sched.batch import ScheduledBatch
from radixserve.sched.scheduler import Scheduler
from radixserve.sched.sessions import check_session_id

log = logging.getLogger("radixserve.engine")

IDLE_WAIT_S = 0.002  # longest wait for background work when a step finds nothing to run

#: SchedulerStats fields that ``stats()`` reports under their own names.
STEP_COUNTERS = ("retractions", "finished_requests", "aborted_requests", "failed_requests", "failed_steps",
                 "prefill_steps", "decode_steps", "mixed_steps", "max_wait_seconds", "tree_seconds")


def resident_bytes() -> int:
    """This process's resident memory (VmRSS), 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def return_freed_heap() -> None:
    """Hand the heap freed by loading (dequantized staging, the loader's copies of packed
    weights) back to the OS: glibc keeps freed blocks mapped, where they count as resident
    for the life of the server. A no-op off glibc. (No ``gc.collect()``: the dropped copies
    hold no cycles, and a full collection over torch's objects would slow every core's start.)"""
    name = ctypes.util.find_library("c")
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return
    if trim is not None:
        trim(0)


class EngineCore:
    """Scheduler + model runner + prefix cache behind a token-id interface."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, *,
                 exit_on_tp_failure: bool = False):
        """``exit_on_tp_failure``: with ``tp_size > 1``, end the process when a rank fails
        (what the engine-core process wants); otherwise the next step raises TPFailure."""
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.threads = self._thread_governor()
        self._owns_weights = loaded is None  # a caller's model may serve other cores: left whole
        self.loaded = self._load(loaded)
        del loaded  # _make_runner may drop the weights this holds
        # "auto": the weights' dtype (a bfloat16 model keeps a bfloat16 cache).
        self.kv_dtype = kv_dtype_name(self.dtype) if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.vocab_size = mc.vocab_size
        self.max_context_len = cfg.max_context_len or mc.max_position_embeddings
        #: A model with Mamba layers: their state pool (refusing what it cannot be served with).
        self.states = make_state_pool(cfg, mc)
        self.tp: TPLeader | None = None
        if cfg.tp_size > 1:
            # Starts the other ranks; raises (ValueError, TPFailure) naming a rank that fails.
            self.tp = TPLeader(cfg, mc, self.dtype, exit_on_failure=exit_on_tp_failure)
        self.allocator = make_allocator(cfg, mc, self.kv_dtype)
        self.runner = self._make_runner()
        self.cache = make_prefix_cache(cfg, self.allocator, self.runner.kv_pool,
                                       weights="+".join(self.runner.model.weight_formats()) or "dense",
                                       states=self.states)
        self.eos_ids: tuple[int, ...] = tuple(self.tokenizer.stop_token_ids)
        if cfg.speculative != "none":
            self._check_exact_verification()
        self.scheduler = Scheduler(cfg, self.allocator, self.cache, self.max_context_len, self.eos_ids,
                                   vocab_size=self.vocab_size, states=self.states)
        self.requests: dict[str, Req] = {}
        self._pending: list[ReqDelta] = []  # finals of requests ended between steps
        #: Structured outputs: a request waits here, outside the scheduler, until its
        #: grammar is compiled.
        self._gate = GrammarGate(self.tokenizer, self.vocab_size)
        self.step_hooks: list[Callable[[], None]] = []  # run after every step (event flush)
        self.started = time.monotonic()
        self.steps = 0
        self._counter = 0
        # Stops the background work when this core is collected or at interpreter exit,
        # whichever comes first (storage threads that call into torch while the interpreter
        # finalizes end the process with std::terminate). A finalizer, not an atexit hook
        # bound to self: that would keep every core, its weights and its KV pool alive
        # until exit.
        self._finalizer = weakref.finalize(self, _stop_background, self._gate, self.cache, self.tp)

    def _thread_governor(self) -> ThreadGovernor | None:
        """Set torch's threads; with the adaptive policy, the governor that lowers them while
        other processes use the cores (one rank only: a tensor-parallel rank's siblings are
        its partners in every step, not load to make room for)."""
        cfg = self.config
        threads = default_threads(cfg)
        if threads:
            torch.set_num_threads(threads)  # process-wide, as torch offers it
        adaptive = cfg.thread_policy == "adaptive" and cfg.tp_size == 1 and cfg.device == "cpu"
        return ThreadGovernor(threads or torch.get_num_threads()) if adaptive else None

    def _load(self, loaded: LoadedModel | None) -> LoadedModel:
        """Choose the activations' dtype and the weights' format; load the model unless the
        caller did (its weights are then taken as they are)."""
        cfg = self.config
        self.dtype_choice = choose_dtype(cfg.dtype, cfg.device, cfg.cpu_isa)
        self.dtype = self.dtype_choice.dtype
        log.info("dtype %s (%s)", self.dtype_choice.name, self.dtype_choice.reason)
        if loaded is None:
            self.weight_choice = choose_weights(
                cfg.weight_dtype, gguf_source=is_gguf_source(cfg.model), dtype=self.dtype, device=cfg.device,
                cpu_isa=cfg.cpu_isa, linear_backend=cfg.linear_backend, tp_size=cfg.tp_size,
                kernels_available=cfg.device != "cpu" or try_load_kernels() is not None)
            loaded = load_model(cfg.model, dtype=self.dtype, weights=self.weight_choice.format,
                                codes_formats=self.weight_choice.codes_formats)
        else:
            self.weight_choice = WeightChoice(loaded.weights, "as loaded by the caller")
        log.info("weights %s (%s)", self.weight_choice.format, self.weight_choice.reason)
        return loaded

    def _make_runner(self) -> ModelRunner:
        """The model runner on the loaded weights; the tensor-parallel ranks are shut down if
        it cannot be built."""
        cfg, loaded = self.config, self.loaded
        try:
            if loaded.vision is not None and self.tp is not None:
                raise ValueError("tp_size > 1 is not supported for a vision-language model")
            runner = ModelRunner.from_config(
                loaded.config, loaded.state_dict, kv_capacity=cfg.kv_cache_tokens, dtype=self.dtype,
                vision=loaded.vision, image_cache_bytes=cfg.image_cache_bytes, device=cfg.device,
                backend=cfg.attention_backend, tp=self.tp, cpu_isa=cfg.cpu_isa, linear_backend=cfg.linear_backend,
                kv_dtype=self.kv_dtype, states=self.states,
                swa_map=self.allocator.swa_map if isinstance(self.allocator, HybridAllocator) else None)
            if self.tp is not None:
                self.tp.wait_ready(loaded.state_dict)
            if runner.model.packed:
                loaded.release_file_pages()
            if self._owns_weights:
                # The runner holds what it computes with (packed panels, or these very tensors):
                # the loader's dict would keep a second copy of every packed weight.
                self.loaded = loaded = dataclasses.replace(loaded, state_dict={})
                return_freed_heap()
            self.rss_after_load = resident_bytes()
            log.info("model %s: %s; resident memory after load %.1f MiB", loaded.name,
                     runner.kernel_info().get("weights", "dense"), self.rss_after_load / 2**20)
            return runner
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise

    def _check_exact_verification(self) -> None:
        """Speculation promises the tokens and logprobs of plain decoding, which holds only
        where a row's logits do not depend on its batch: refuse, naming the field, where the
        kernels that guarantee it do not run."""
        why = self.runner.batch_invariance_gap()
        if why is not None:
            raise ValueError(f"speculative={self.config.speculative!r} needs batch-invariant kernels "
                             f"so that verified tokens equal plain decoding's: {why}")

    def close(self) -> None:
        """Stop background work (storage threads, tensor-parallel ranks); the core cannot step
        afterwards. Idempotent; also run at interpreter exit or when the core is collected."""
        self._finalizer()  # runs its function once; later calls do nothing

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The request as the core will run it, or ValueError naming what is wrong."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not all(type(t) is int for t in prompt_ids):
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
                    session_id: str | None = None, images: Sequence[ImageInput] | None = None,
                    low_priority_from: int | None = None) -> None:
        """Queue a request. Raises ValueError on bad input, changing nothing. With a
        ``session_id`` its cached tokens are kept for the session's next turn
        (``sched/sessions.py``). ``images``: for a vision-language model, one per image
        placeholder token of the prompt, in order (``radixserve.images``).
        ``low_priority_from``: the tokens it caches from this position on (in the prefix
        cache's key space: images expanded) are evicted before all others
        (``radixserve.cache.radix``); a router sets it where the prompt leaves what its
        siblings share."""
        if not isinstance(rid, str) or not rid:
            raise ValueError("request id must be a non-empty string")
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt must be a string or None, got {type(salt).__name__}")
        check_session_id(session_id)
        check_low_priority_from(low_priority_from)
        prompt_ids, spans, imgs = expand_images(self.loaded.vision, rid, prompt_ids, images, model=self.config.model,
                                                content_keys=self.config.image_content_keys)
        ids = self.validate(prompt_ids, params)
        req = Req(rid=rid, prompt_ids=ids, params=params, salt=salt, session_id=session_id,
                  images=ReqImages(imgs, spans) if spans else None, low_priority_from=low_priority_from)
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
        if spec is None or self._gate.submit(req, spec):
            self.scheduler.add(req)

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar now (cached), raising GrammarError (a ValueError)
        naming the field if it cannot be used: for callers that must refuse a request before
        it is queued (the in-process ``Engine``; the server does it in its own process)."""
        self._gate.check(params)

    def _admit_compiled(self, out: list[ReqDelta]) -> None:
        """Requests whose grammar finished compiling join the scheduler's queue; one whose
        grammar failed ends alone with its error."""
        for req, err in self._gate.finished():
            if err is None:
                self.scheduler.add(req)
                continue
            req.end("error", str(err) if isinstance(err, ValueError) else f"grammar: {type(err).__name__}: {err}")
            self._ended(req, out)

    def abort(self, rid: str, reason: str = "abort", error: str | None = None) -> bool:
        """End a request now; its slots and locks are released at once and its final delta
        comes with the next step's outputs. False if there is no such running request."""
        req = self.requests.pop(rid, None)
        if req is None or req.finished:
            return False
        if self._gate.compiling.pop(rid, None) is not None:  # never reached the scheduler
            req.end(reason, error)
        else:
            self.scheduler.finish(req, reason, error)
        self._pending.append(delta_of(req, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or bool(self._gate.compiling)

    # ------------------------------------------------------------------ the loop body
    def step(self) -> list[ReqDelta]:
        """Run one scheduled batch; return a delta for every request that advanced or ended."""
        out, self._pending = self._pending, []
        if self._gate.compiling:
            self._admit_compiled(out)
        sched = self.scheduler.schedule()
        for req in sched.failed:
            self._ended(req, out)
        batch = sched.batch
        if batch is None and not sched.failed and self._gate.compiling and not self.scheduler.waiting:
            # Only grammars are being compiled: wait for one instead of spinning.
            self._gate.wait(IDLE_WAIT_S)
        elif batch is None and not sched.failed and self.scheduler.waiting:
            # Nothing could run (e.g. prefixes still coming from storage): wait for the
            # background work instead of spinning the caller's loop.
            self.cache.wait_background(IDLE_WAIT_S)
        if batch is not None:
            self._run(batch, out)
        for hook in self.step_hooks:
            hook()
        return out

    def _run(self, batch: ScheduledBatch, out: list[ReqDelta]) -> None:
        """Run the batch and apply its result (or fail its requests if the forward raised).
        The run's CPU time (the forward, the sampling and the drafts' verification) is what
        the scheduler prices draft rows by: CPU time, because on a shared host the wall
        clock also counts the time other work held the cores; not the bookkeeping after it,
        because a request that ends puts its sequence into the tree then, which has nothing
        to do with the rows of the step it ended in."""
        self.steps += 1
        if self.threads is not None:
            self.threads.before_step()
        before = [len(r.output_ids) for r in batch.reqs]
        t0 = time.process_time()
        try:
            result = self.runner.run(batch, self._gate.constraints(batch), self._gate.draft_constraints(batch))
        except TPFailure:  # the ranks are out of step: the engine cannot go on
            raise
        except Exception as e:  # a fault no single request explains: this batch fails
            log.exception("forward pass failed; failing the %d request(s) of its batch", len(batch.reqs))
            for req in self.scheduler.fail_batch(batch, f"engine step failed: {type(e).__name__}: {e}"):
                self._ended(req, out)
            return
        self.scheduler.observe_step(batch, time.process_time() - t0)
        self.scheduler.postprocess(batch, result.rows, result.verified)
        for i, req in enumerate(batch.reqs):
            plp = result.prompt_logprobs[i]
            if plp is not None:
                req.prompt_logprobs.extend(plp[0])
                req.prompt_top_logprobs.extend(plp[1])
            new = req.output_ids[before[i]:]
            if new or req.finished:
                out.append(sampled_delta(req, new, result.rows_of(i) if new else []))
                if req.finished:
                    self.requests.pop(req.rid, None)

    def _ended(self, req: Req, out: list[ReqDelta]) -> None:
        self.requests.pop(req.rid, None)
        out.append(delta_of(req, []))

    # ------------------------------------------------------------------ utilities
    def load(self) -> Load:
        s = self.scheduler
        return Load(s.num_unfinished - len(s.waiting), len(s.waiting), self.allocator.available)

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (metrics, server info): tokens, memory, steps, what was chosen
        at load, then each part's own."""
        sch = self.scheduler
        return {**self._token_stats(), **self._memory_stats(), **self._step_stats(), **self._choice_stats(),
                **sch.sessions.stats(), **sch.mamba.stats(), **self.runner.kernel_info(),
                **({"hicache": self.cache.stats()} if self.config.hicache_l2_tokens else {}),
                **({"tp": self.tp.stats()} if self.tp is not None else {})}

    def _token_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        q = s.prefix_query_tokens
        return {"prefix_cache_query_tokens": q, "prefix_cache_hit_tokens": s.prefix_hit_tokens,
                "prefix_cache_hit_rate": (s.prefix_hit_tokens / q) if q else 0.0,
                "computed_prefill_tokens": s.computed_prefill_tokens, "generated_tokens": s.generated_tokens,
                "image_query_tokens": s.image_query_tokens, "cached_image_tokens": s.image_hit_tokens,
                **self.runner.image_stats(), "grammar_forced_tokens": s.forced_tokens,
                "speculative_draft_tokens": s.draft_tokens, "speculative_accepted_tokens": s.accepted_draft_tokens,
                "speculative_verified_rows": s.verified_rows, **self._gate.stats()}

    def _memory_stats(self) -> dict[str, Any]:
        sch, cache = self.scheduler, self.cache
        cap, free = self.allocator.capacity, self.allocator.available
        running = sch.running + ([sch.chunked] if sch.chunked else [])
        private = sum(r.computed_len - r.prefix_len + int(r.spare_slots.numel()) for r in running)
        return {"running_requests": len(running), "waiting_requests": len(sch.waiting),
                "kv_capacity_tokens": cap, "kv_free_tokens": free, "kv_used_tokens": cap - free - cache.evictable_size,
                "kv_usage": (cap - free) / cap, "cached_tokens": cache.total_size,
                "evictable_tokens": cache.evictable_size, "protected_tokens": cache.protected_size,
                "private_tokens": private, "evicted_tokens": cache.evicted_tokens}

    def _step_stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {**{name: getattr(s, name) for name in STEP_COUNTERS},
                "forward_seconds": self.runner.forward_seconds, "steps": self.steps}

    def _choice_stats(self) -> dict[str, Any]:
        gov = self.threads
        return {"threads": gov.threads if gov is not None else torch.get_num_threads(),
                "thread_changes": gov.changes if gov is not None else 0,
                "dtype": self.dtype_choice.name, "dtype_reason": self.dtype_choice.reason,
                "weight_dtype": self.weight_choice.format, "weight_dtype_reason": self.weight_choice.reason,
                "rss_after_load_bytes": self.rss_after_load, "kv_cache_dtype": self.kv_dtype,
                "kv_bytes_per_token": self.runner.kv_pool.bytes_per_token}

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests are in flight."""
        return self.scheduler.flush_cache()

    def check_integrity(self) -> dict[str, Any]:
        """Raise AssertionError if an invariant is broken; returns the stats checked against."""
        self.scheduler.check_integrity()
        self._check_kv_scales()
        live = {r.rid for r in self.scheduler.all_reqs()} | set(self._gate.compiling)
        if live != set(self.requests):
            raise AssertionError(f"request table out of sync: {sorted(live ^ set(self.requests))[:5]}")
        stats = self.stats()
        if self.tp is not None:
            stats["tp_check"] = self.tp.check()  # every rank used the same slots, step by step
        return stats

    def _check_kv_scales(self) -> None:
        """A quantized pool: every slot holding written K/V has valid scales (in each pool of
        a hybrid model)."""
        pool = self.runner.kv_pool
        if pool.quantized:
            pool.check_scales(self.allocator.written.nonzero().reshape(-1))

    def model_info(self) -> ModelInfo:
        """What the API side needs to know about the model (sent once at startup)."""
        vision = vision_info(self.loaded.vision)
        return ModelInfo(
            model=self.config.model, arch=getattr(self.model_config, "arch", None),
            vocab_size=self.vocab_size, max_context_len=self.max_context_len, eos_ids=list(self.eos_ids),
            kv_capacity_tokens=self.allocator.capacity,
            max_running_requests=self.config.max_running_requests, page_size=self.config.page_size,
            dtype=str(self.dtype).removeprefix("torch."), kv_cache_dtype=self.kv_dtype,
            tp_size=self.config.tp_size, vision=VisionSpec(**vision) if vision is not None else None)

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


def _stop_background(gate: GrammarGate, cache: Any, tp: Any) -> None:
    """What :meth:`EngineCore.close` stops; a function of the parts, not of the core, so the
    finalizer that calls it does not keep the core alive."""
    gate.close()
    cache.close()
    if tp is not None:
        tp.shutdown()
