"""What the request handlers share: the engine client, the tokenizer, limits, request ids.

Tokenization and chat templates run on a small thread pool, never on the event loop: a long
prompt must not stall ``/health`` or the streams of other clients (the tokenizer releases
the GIL on long texts, see ``Tokenizer.encode``).

Images are decoded, preprocessed and hashed on a pool of their own (``server/images.py``),
so a request with large pictures never delays the tokenization of text-only requests.

Request ids are always generated here. A client-chosen id (``rid`` of ``/generate``) is a
name in its tenant's namespace only: another tenant can neither see that it exists nor
abort it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from radixserve.chat_template import ChatTemplateError, ServedChatTemplate, render_chat
from radixserve.config import ServerConfig
from radixserve.request import RequestOutput
from radixserve.engine.async_client import AsyncEngineClient, RequestStream
from radixserve.engine.client import Submission
from radixserve.engine.messages import ModelInfo
from radixserve.engine.limits import check_fits
from radixserve.images import ImageInput
from radixserve.sampling_params import SamplingParams
from radixserve.protocol.rules import RequestLimits
from radixserve.server.cache_hint import request_low_priority_from
from radixserve.server.pipeline import Choices, Renderer, merge, raise_if_failed
from radixserve.server.auth import KeyRing, Principal, cache_salt, principal_of
from radixserve.server.errors import APIError, unavailable
from radixserve.server.images import ImageLimits, VisionInfo, check_count, load_image, no_images
from radixserve.server.metrics import ServerMetrics
from radixserve.server.render import TokenText
from radixserve.server.session_ids import session_key
from radixserve.server.sse import sse_response

logger = logging.getLogger("radixserve.server")


class ServerContext:
    def __init__(self, cfg: ServerConfig, client: AsyncEngineClient, tokenizer: Any,
                 model_name: str, engine_model: str, keyring: KeyRing, metrics: ServerMetrics):
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.engine_model = engine_model
        self.keyring = keyring
        self.metrics = metrics
        self.texts = TokenText(tokenizer)
        self.chat_template = ServedChatTemplate.choose(tokenizer.chat_template, tokenizer.chat_template_builtin,
                                                       cfg.chat_template)
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixserve-tokenize")
        self.image_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="radixserve-image")
        self.image_limits = ImageLimits.from_config(cfg)
        self.limits = RequestLimits.from_config(cfg)
        self._vision: tuple[VisionInfo | None] | None = None  # from the core's info, once ready
        # internal rid -> (tenant, client rid or None, log label, submit time)
        self.owner: dict[str, tuple[str | None, str | None, str, float]] = {}
        self.client_rids: dict[tuple[str | None, str], str] = {}
        self._grammars: Any = None  # GrammarCompiler, built on the first structured request
        self._compiling = 0  # requests waiting for their grammar's compile (count as in flight)
        client.on_output.append(self._on_output)

    # ------------------------------------------------------------------ engine state
    @property
    def info(self) -> ModelInfo | None:
        """The core's model info (None until the core is ready)."""
        return self.client.info

    @property
    def model(self) -> ModelInfo:
        """The core's model info, for a request: 503 while the core is starting or gone."""
        self.check_ready()
        return self.client.info

    @property
    def vision(self) -> VisionInfo | None:
        """The model's image input (None: a text model, or the core is not ready yet)."""
        if self._vision is None:
            if self.info is None:
                return None
            self._vision = (VisionInfo.from_spec(self.info.vision, self.tokenizer),)
        return self._vision[0]

    def close(self) -> None:
        self.executor.shutdown(wait=False)
        self.image_executor.shutdown(wait=False)

    @property
    def max_context_len(self) -> int:
        return self.info.max_context_len if self.info is not None else 0

    def check_ready(self) -> None:
        if self.client.dead_reason is not None:
            raise unavailable(self.client.dead_reason)
        if not self.client.ready:
            raise APIError(503, "the engine is starting; retry shortly", "service_unavailable",
                           code="engine_starting", headers={"Retry-After": "2"})

    def check_model(self, model: str | None) -> None:
        if model in (None, "", "default", self.model_name, self.engine_model):
            return
        raise APIError(400, f"model {model!r} is not served here; available: {self.model_name!r}",
                       param="model", code="model_not_found")

    # ------------------------------------------------------------------ input
    async def encode(self, prompt: str | list[int], field: str = "prompt", *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text is a raw prompt (the model's BOS first when its
        tokenizer wants one, :meth:`Tokenizer.encode_prompt`), or with ``chat`` a rendered
        chat template (which writes BOS itself). The router's RequestTokenizer encodes the
        same way, so both see the same ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, f"{field} must not be empty", param=field)
            self.limits.text(prompt, field)
            fn = self.tokenizer.encode if chat else self.tokenizer.encode_prompt
            ids = await asyncio.get_running_loop().run_in_executor(self.executor, fn, prompt)
            if not ids:
                raise APIError(400, f"{field} must not be empty (it encodes to no tokens)", param=field)
            return ids
        if not prompt:
            raise APIError(400, f"{field} must not be empty", param=field)
        vocab = self.model.vocab_size
        bad = next((t for t in prompt if t < 0 or (vocab and t >= vocab)), None)
        if bad is not None:
            raise APIError(400, f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", param=field)
        return list(prompt)

    async def encode_prediction(self, prediction: Any) -> list[int] | None:
        """Token ids of an OpenAI ``prediction`` (:class:`~radixserve.protocol.openai.
        Prediction`), or None for none (or empty text): the text as the answer would hold it,
        tokenized without BOS. 400 naming ``prediction.content`` when it is too long or not
        valid Unicode."""
        if prediction is None:
            return None
        text = prediction.text()
        if not text:
            return None
        self.limits.text(text, "prediction.content")
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.tokenizer.encode, text) or None

    def check_images(self, refs: Sequence[tuple[str, str]], count_field: str) -> None:
        """400 before any work when a request has images a text model cannot take, or too many."""
        if refs and self.vision is None:
            raise no_images(refs[0][0])
        if refs:
            check_count(len(refs), self.image_limits, count_field)

    async def load_images(self, refs: Sequence[tuple[str, str]], count_field: str) -> list[ImageInput]:
        """The images of one prompt, from ``(field, reference)`` pairs (data URI, base64, or
        an http(s) URL where allowed), decoded and hashed off the event loop; 400 naming the
        field for a text model, too many images, or an image that cannot be used."""
        if not refs:
            return []
        self.check_images(refs, count_field)
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self.image_executor, load_image, ref, field, self.image_limits, self.vision)
                for field, ref in refs]
        try:
            return list(await asyncio.gather(*jobs))
        finally:
            for j in jobs:
                j.cancel()  # the ones not started yet, when another failed

    @property
    def grammars_compiled(self) -> int:
        """Grammars this process compiled (cache misses)."""
        return self._grammars.compiled if self._grammars is not None else 0

    async def check_grammars(self, params: Sequence[SamplingParams], field: str | None = None,
                             prefix: str = "") -> None:
        """Compile every distinct grammar of ``params`` (on the grammar pool, cached) and
        answer 400 naming the field if one cannot be used — before anything is queued.

        Compiling costs up to a second of CPU, so a request that would get a 429 gets it
        first, and requests waiting for a compile count against the capacity: distinct
        grammars sent faster than they compile are refused, not piled up."""
        specs = {p.grammar.key: p.grammar for p in params if p.grammar is not None}
        if not specs:
            return
        if self._grammars is None:
            from radixserve.grammar.compiler import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.model.vocab_size, max_workers=2)
        if all(self._grammars.cached(spec) is not None for spec in specs.values()):
            return
        self.admit(len(params))
        self._compiling += len(params)
        try:
            for spec in specs.values():
                try:
                    await self._grammars.acompile(spec)
                except ValueError as e:
                    name = field or prefix + (getattr(e, "field", None) or spec.kind)
                    msg = str(e) if field is not None or not prefix else prefix + str(e)
                    if field is not None and not msg.startswith(field):
                        msg = f"{field}: {msg}"
                    raise APIError(400, msg, param=name, code="invalid_grammar") from None
        finally:
            self._compiling -= len(params)

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None) -> str:
        template = self.chat_template.template
        if template is None:
            raise APIError(400, self.chat_template.missing_message(self.model_name), code="chat_template_missing")
        for i, m in enumerate(messages):
            c = m.get("content")
            if isinstance(c, str):
                self.limits.text(c, f"messages[{i}].content")
        total = sum(len(m.get("content") or "") for m in messages)
        if total > self.cfg.max_prompt_chars:
            raise APIError(400, f"messages have {total} characters; the limit is {self.cfg.max_prompt_chars}",
                           param="messages", code="prompt_too_long")
        extra: dict[str, Any] = {}
        if tools:
            if "tools" in template:
                extra["tools"] = tools  # the template describes them its own way
            else:
                messages = with_tools_system_prompt(messages, tools)
        loop = asyncio.get_running_loop()
        tok = self.tokenizer
        try:
            return await loop.run_in_executor(
                self.executor,
                lambda: render_chat(template, messages, add_generation_prompt, bos_token=tok.bos_token or "",
                                    eos_token=tok.eos_token or "", **extra))
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages", code="chat_template_error") from None

    # ------------------------------------------------------------------ submission
    def admit(self, n: int) -> None:
        """429 when ``n`` more requests would exceed the running + queued capacity."""
        self.check_ready()
        cap = self.model.max_running_requests + self.cfg.max_queued_requests
        inflight = len(self.client.streams) + self._compiling
        if inflight + n > cap:
            raise APIError(429, f"the server is at capacity ({inflight} requests in flight); retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})

    def submit(self, request: Request, choices: Choices, request_salt: str | None, prefix: str) -> list[RequestStream]:
        """Queue every choice of a request (``choices``), as the caller's tenant; the
        ``X-Cache-Low-Priority-From`` header applies to every choice."""
        self.admit(len(choices.items))
        info = self.model
        vision = self.vision
        for (ids, params), ims in zip(choices.items, choices.images):
            n = vision.prompt_len(ids, len(ims)) if vision is not None and ims else len(ids)
            check_fits(n, params.max_tokens, self.max_context_len, info.kv_capacity_tokens, info.page_size)
        principal = principal_of(request)
        tenant = principal.tenant
        for crid in choices.client_rids:
            if crid is not None and (tenant, crid) in self.client_rids:
                raise APIError(400, f"rid {crid!r} is already in use", param="rid")
        salt = cache_salt(principal, request_salt)
        low_priority_from = request_low_priority_from(request)
        base = uuid.uuid4().hex
        rids = [f"{prefix}{base}-{k}" for k in range(len(choices.items))]
        subs = [Submission(rid, ids, params, salt, session_key(principal, sid), tuple(ims), low_priority_from)
                for rid, (ids, params), sid, ims in zip(rids, choices.items, choices.session_ids, choices.images)]
        streams = self.client.submit(subs)
        self.metrics.observe_images(choices.images, tenant)
        now = time.monotonic()
        for rid, crid, label in zip(rids, choices.client_rids, choices.labels):
            self.owner[rid] = (tenant, crid, label, now)
            if crid is not None:
                self.client_rids[(tenant, crid)] = rid
        return streams

    def label(self, prompt: str | list[int]) -> str:
        if not self.cfg.log_requests:
            return f"<{len(prompt)} {'chars' if isinstance(prompt, str) else 'token ids'}>"
        if isinstance(prompt, str):
            return repr(prompt[:200] + ("…" if len(prompt) > 200 else ""))
        return f"<{len(prompt)} token ids>"

    def _on_output(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        tenant, crid, label, submitted = self.owner.pop(out.request_id, (None, None, "", time.monotonic()))
        if crid is not None:
            self.client_rids.pop((tenant, crid), None)
        self.metrics.observe_finished(out, submitted, tenant)
        ttft = (out.first_token_time - out.arrival_time) if out.first_token_time else None
        logger.info(
            "request %s tenant=%s finish=%s prompt=%s prompt_tokens=%d cached=%d generated=%d "
            "ttft=%s latency=%.3fs%s",
            out.request_id, tenant or "-", out.finish_reason, label, out.prompt_tokens,
            out.cached_tokens, len(out.token_ids), f"{ttft:.3f}s" if ttft is not None else "-",
            (out.finish_time or time.monotonic()) - submitted,
            f" error={out.error!r}" if out.error else "",
        )

    # ------------------------------------------------------------------ abort
    def find(self, principal: Principal, rid: str) -> str | None:
        """The internal id of request ``rid`` as this principal may name it, or None."""
        tenant = principal.tenant
        internal = self.client_rids.get((tenant, rid))
        if internal is not None:
            return internal
        owner = self.owner.get(rid)
        if owner is not None and (principal.admin or owner[0] == tenant):
            return rid
        if principal.admin:
            return next((internal for (_, crid), internal in self.client_rids.items() if crid == rid), None)
        return None

    def abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.client.abort(s.rid)

    # ------------------------------------------------------------------ answering
    async def respond(self, renderer: Renderer, streams: list[RequestStream], request: Request, stream: bool) -> Any:
        """The response: SSE chunks as they come, or (after every choice finished) one body."""
        if stream:
            return sse_response(renderer.stream(), self, streams)
        finals = await self.wait_all(streams, request)
        for out in finals:
            raise_if_failed(out)
        return renderer.final(finals)

    async def wait_all(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Final outputs of ``streams``; aborts them if the client goes away meanwhile."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.25)
                if await request.is_disconnected():
                    logger.info("client disconnected; aborting %d request(s)", len(streams))
                    self.abort_unfinished(streams)
                    return

        watcher = asyncio.create_task(watch())
        try:
            async for i, out in merge(streams):
                if out.finished:
                    finals[i] = out
        finally:
            watcher.cancel()
            self.abort_unfinished(streams)
        return finals  # type: ignore[return-value]


def with_tools_system_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a template without tool support: the tools described in the system
    message (appended to the client's own), earlier calls written out in the call format."""
    from radixserve.grammar.tools import parse_tools, render_calls_as_text, system_prompt

    desc = system_prompt(parse_tools(tools))
    msgs = [render_calls_as_text(m) if m.get("role") == "assistant" else m for m in messages]
    if msgs and msgs[0].get("role") == "system":
        return [{**msgs[0], "content": (msgs[0].get("content") or "") + "\n\n" + desc}, *msgs[1:]]
    return [{"role": "system", "content": desc}, *msgs]

