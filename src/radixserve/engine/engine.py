"""The in-process engine: text in, text out, one step at a time, in the caller's thread.

``Engine`` is the library face of radixserve: an :class:`EngineCore` (token ids, the
scheduler, the model, the prefix cache) plus the tokenizer and an
:class:`OutputProcessor` (detokenization, stop strings). ``step()`` runs the core's loop
body once and turns its deltas into :class:`RequestOutput` s. It is single-threaded on
purpose; servers and concurrent programs drive a core through ``engine/loop.py`` instead.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from typing import Any, Self

import torch

from radixserve.config import DEFAULT_MODEL, DEFAULT_POLICY, EngineConfig
from radixserve.request import RequestOutput
from radixserve.engine.core import EngineCore
from radixserve.engine.output import OutputProcessor
from radixserve.images import ImageInput
from radixserve.model.registry import LoadedModel
from radixserve.sampling_params import SamplingParams


class Engine:
    """An LLM engine with a RadixAttention prefix cache.

    >>> eng = Engine("smollm2-135m")                      # doctest: +SKIP
    >>> eng.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))

    ``Engine(model, cache=..., policy=..., **options)`` or ``Engine(config=EngineConfig(...))``;
    options are the fields of :class:`EngineConfig`.
    """

    def __init__(self, model: str | LoadedModel = DEFAULT_MODEL, cache: str = "radix",
                 policy: str = DEFAULT_POLICY, *, config: EngineConfig | None = None, **options: Any):
        if config is None:
            unknown = set(options) - set(EngineConfig.field_names())
            if unknown:
                raise ValueError(f"unknown engine option(s): {sorted(unknown)}")
            name = model.name if isinstance(model, LoadedModel) else model
            config = EngineConfig(model=name, cache=cache, policy=policy, **options)
        elif options:
            raise ValueError("pass either config= or engine options, not both")
        self.core = EngineCore(config, model if isinstance(model, LoadedModel) else None)
        self.config = config
        self.tokenizer = self.core.tokenizer
        self.outputs = OutputProcessor(self.tokenizer)

    # Read-only views used by tools and tests.
    @property
    def scheduler(self):  # noqa: ANN201
        return self.core.scheduler

    @property
    def cache(self):  # noqa: ANN201
        return self.core.cache

    @property
    def allocator(self):  # noqa: ANN201
        return self.core.allocator

    @property
    def runner(self):  # noqa: ANN201
        return self.core.runner

    @property
    def max_context_len(self) -> int:
        return self.core.max_context_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def model_config(self):  # noqa: ANN201
        return self.core.model_config

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (ids are checked to be ints). Text is a raw prompt: it gets
        the model's BOS when its tokenizer wants one (:meth:`Tokenizer.encode_prompt`), as
        the server's /v1/completions and /generate do; a chat prompt already rendered to text
        starts with the template's BOS, so it gets no second one."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode_prompt(prompt)
            if not ids:
                raise ValueError("prompt must not be empty (it encodes to no tokens)")
            return ids
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            return prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must be integers")
            return list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None,
                    session_id: str | None = None, images: Sequence[Any] | None = None,
                    low_priority_from: int | None = None) -> str:
        """Queue a request; returns its id. Raises ValueError on bad input, changing nothing.
        With ``session_id``, the conversation's cached tokens stay locked for the session's
        next turn (until :meth:`close_session`, the engine's ``session_ttl_s`` or memory
        pressure; see ``radixserve.sched.sessions``). ``images`` (a vision-language model):
        PIL images, encoded image bytes or ``ImageInput``s, one per image placeholder of the
        prompt (``<image>`` in text), in order. ``low_priority_from``: what the request
        caches from this token position on is evicted before everything else."""
        params = params if params is not None else SamplingParams()
        ids = self.encode(prompt)
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self.outputs:
            raise ValueError(f"request_id {rid!r} is already in use")
        self.core.check_grammar(params)  # a grammar that cannot compile is refused here
        inputs = self._image_inputs(images)
        self.core.add_request(rid, ids, params, salt=salt, session_id=session_id, images=inputs,
                              low_priority_from=low_priority_from)
        self.outputs.add(rid, self.core.requests[rid].prompt_ids, params, self.core.requests[rid].arrival)
        return rid

    def _image_inputs(self, images: Sequence[Any] | None) -> list[ImageInput] | None:
        if not images:
            return None
        vision = self.core.loaded.vision
        if vision is None:
            raise ValueError(f"images: model {self.core.config.model!r} does not accept images")
        from radixserve.model.vision.image_processor import image_input

        return [image_input(im, vision.processor) for im in images]

    def abort(self, request_id: str) -> bool:
        """Stop a request now; slots and locks are released at once, and its final output
        (``finish_reason="abort"``) comes with the next ``step()``."""
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; outputs of every request that advanced or ended."""
        outs, stop = self.outputs.process(self.core.step())
        for rid in stop:
            self.core.abort(rid, "stop")
        return outs

    def run_until_done(self, max_steps: int | None = None) -> list[RequestOutput]:
        finals: list[RequestOutput] = []
        steps = 0
        while self.has_unfinished():
            finals.extend(o for o in self.step() if o.finished)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        return finals

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, salt: str | None = None,
                 session_id: str | None = None,
                 images: Sequence[Sequence[Any] | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (offline batch); outputs in the order of ``prompts``.
        ``session_id`` applies to every prompt (the last one to finish is what it keeps).
        ``images``: per prompt, its images (see :meth:`add_request`)."""
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and bool(prompts)
                                              and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if not plist:
            return []
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(plist)} prompts")
        if single and images is not None and (not images or not isinstance(images[0], (list, tuple))):
            images = [images]  # one prompt's images
        per_prompt = list(images) if images is not None else [None] * len(plist)
        if len(per_prompt) != len(plist):
            raise ValueError(f"images has {len(per_prompt)} entries for {len(plist)} prompts")
        rids: list[str] = []
        try:
            for p, sp, ims in zip(plist, params, per_prompt):
                rids.append(self.add_request(p, sp, salt=salt, session_id=session_id, images=ims))
        except ValueError:
            for rid in rids:
                self.abort(rid)
                self.outputs.discard(rid)
            raise
        wanted = set(rids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(wanted):
            for o in self.step():
                if o.finished and o.request_id in wanted:
                    done[o.request_id] = o
        return [done[r] for r in rids]

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield this request's output after every step that advances it (deltas)."""
        rid = self.add_request(prompt, sampling_params)
        try:
            while True:
                for o in self.step():
                    if o.request_id == rid:
                        yield o
                        if o.finished:
                            return
        finally:
            if rid in self.outputs:
                self.abort(rid)
                self.outputs.discard(rid)

    def close(self) -> None:
        """Stop background work and, with ``tp_size > 1``, the other ranks' processes."""
        self.core.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ observability
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while requests are in flight."""
        return self.core.flush_cache()

    def check_integrity(self) -> dict[str, Any]:
        return self.core.check_integrity()

    def open_session(self, session_id: str, ttl_s: float | None = None) -> bool:
        """Open a session with its own TTL; requests open theirs implicitly. False if open."""
        return self.core.open_session(session_id, ttl_s)

    def close_session(self, session_id: str) -> bool:
        """Release what a session keeps cached, now; False if it was not open."""
        return self.core.close_session(session_id)
