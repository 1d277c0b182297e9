"""The HTTP server: OpenAI-compatible API, SGLang's native API, metrics and health.

``create_app(engine)`` builds a FastAPI app around one Engine. The engine runs on the
bridge's thread (see ``bridge.py``); handlers only tokenize, submit, and turn
``RequestOutput``s into the response shapes of the two APIs:

- OpenAI: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming, n > 1, logprobs),
  ``/v1/models``;
- SGLang: ``/generate``, ``/get_model_info``, ``/server_info`` (``/get_server_info``),
  ``/flush_cache``, ``/abort_request``, ``/health``, ``/health_generate`` — shaped so that
  ``sglang.RuntimeEndpoint`` and scripts written for SGLang work unchanged;
- ``/metrics`` (Prometheus) and ``/debug/integrity`` (engine invariants, for tests/ops).

Every error, bad input or bug, is answered in OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``; bad input is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.core import RequestOutput
from radixserve.model.tokenizer import bytes_to_unicode
from radixserve.sampling_params import SamplingParams
from radixserve.server.bridge import EngineBridge, EngineError, RequestStream
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    FlushCacheRequest,
    GenerateRequest,
    native_sampling_params,
)

logger = logging.getLogger("radixserve.server")

VERSION = "0.1.0"
# Paths that answer without an API key: liveness probes must not need secrets.
_PUBLIC_PATHS = frozenset({"/health", "/health_generate"})


# --------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered in OpenAI's shape with a chosen HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": type, "param": param, "code": code}},
    )


def _error_chunk(message: str, type: str = "server_error", code: int = 500) -> str:
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n"


def _sse_response(body: AsyncIterator[str], srv: Any, streams: Sequence[RequestStream]) -> StreamingResponse:
    """Stream SSE chunks; shared by every streaming endpoint so they end the same way.

    An error mid-stream (the status line is already sent) becomes an OpenAI-shaped error
    chunk; every stream ends with ``data: [DONE]``; requests still running when the stream
    stops (client gone, error) are aborted so their slots and locks are freed at once.
    """

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in body:
                yield chunk
        except APIError as e:
            yield _error_chunk(e.message, e.type, e.status)
        except EngineError as e:
            yield _error_chunk(str(e))
        finally:
            srv.abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('msg', '')})", None
    if e.get("type") == "missing" and param:
        return f"{param}: field required", param
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object (send Content-Type: application/json)", None
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        return error_response(400, msg, param=param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        # The engine and SamplingParams raise ValueError for bad input, naming the field.
        return error_response(400, str(exc))

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(500, str(exc), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


class _ApiKeyMiddleware:
    """Bearer-token check as plain ASGI (BaseHTTPMiddleware would get in the way of
    streaming responses and of disconnect detection)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in _PUBLIC_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        got = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                got = v
                break
        if hmac.compare_digest(got, self.expected):
            await self.app(scope, receive, send)
            return
        resp = error_response(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
        )
        await resp(scope, receive, send)


# --------------------------------------------------------------------------- helpers
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(t)
                out = t.result()
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
                yield i, out
    finally:
        for t in pending:
            t.cancel()


class _TokenText:
    """Per-token strings and raw bytes, for logprobs (cached: the same ids come back often)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._str: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._inv = {c: b for b, c in bytes_to_unicode().items()}

    def bytes(self, tid: int) -> bytes:
        b = self._bytes.get(tid)
        if b is None:
            piece = self.tok.id_to_token(tid) or ""
            if piece and all(c in self._inv for c in piece):
                b = bytes(self._inv[c] for c in piece)  # byte-level BPE: exact bytes
            else:
                b = self.tok.decode([tid], skip_special_tokens=False).encode()
            self._bytes[tid] = b
        return b

    def text(self, tid: int) -> str:
        s = self._str.get(tid)
        if s is None:
            b = self.bytes(tid)
            try:
                s = b.decode("utf-8")
            except UnicodeDecodeError:
                # OpenAI's convention for a token that is part of a multi-byte character.
                s = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._str[tid] = s
        return s


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _group_usage(finals: Sequence[RequestOutput], n: int) -> dict[str, Any]:
    """Usage of a request fanned out to ``n`` choices per prompt.

    Prompt tokens count once per prompt (OpenAI's convention for n > 1); cached tokens are the
    most any choice of that prompt took from the cache; completion tokens are summed.
    """
    prompt = cached = completion = 0
    for g in range(0, len(finals), n):
        group = finals[g : g + n]
        prompt += group[0].prompt_tokens
        cached += max(o.cached_tokens for o in group)
        completion += sum(len(o.token_ids) for o in group)
    return _usage(prompt, completion, cached)


def _openai_finish(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return out.finish_reason if out.finish_reason in ("stop", "length") else (out.finish_reason or "stop")


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        # The scheduler fails a request it can never fit (e.g. prompt + max_tokens larger
        # than the KV pool): a property of the request on this server, so a 400.
        raise APIError(400, out.error or "the request failed", code="request_failed")


# --------------------------------------------------------------------------- the app
class _Server:
    """State shared by the handlers of one app."""

    def __init__(self, engine: Any, bridge: EngineBridge, metrics: ServerMetrics,
                 served_model_name: str):
        self.engine = engine
        self.bridge = bridge
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_context_len: int = engine.max_context_len
        self.texts = _TokenText(engine.tokenizer)
        self.created = int(time.time())

    # ---- input
    def check_model(self, model: str | None) -> None:
        if model in (None, "", "default", self.model_name, self.engine.config.model):
            return
        raise APIError(400, f"model {model!r} is not served here; available: {self.model_name!r}",
                       param="model", code="model_not_found")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise ValueError("prompt must not be empty (it encodes to no tokens)")
            return ids
        return list(prompt)

    @staticmethod
    def label(prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt[:60] + ("…" if len(prompt) > 60 else "")
        return f"<{len(prompt)} token ids>"

    # ---- output: logprob shapes
    def chat_logprob_entries(self, token_ids: Sequence[int], lps: Sequence[float],
                             tops: Sequence[Sequence[tuple[int, float]]] | None) -> list[dict]:
        entries = []
        for k, (tid, lp) in enumerate(zip(token_ids, lps)):
            top = tops[k] if tops is not None and k < len(tops) else []
            entries.append({
                "token": self.texts.text(tid),
                "logprob": lp,
                "bytes": list(self.texts.bytes(tid)),
                "top_logprobs": [
                    {"token": self.texts.text(t), "logprob": v, "bytes": list(self.texts.bytes(t))}
                    for t, v in top
                ],
            })
        return entries

    def completion_logprobs(self, token_ids: Sequence[int], lps: Sequence[float | None],
                            tops: Sequence[Sequence[tuple[int, float]]] | None,
                            offset: int) -> dict[str, Any]:
        tokens, offsets, top_dicts = [], [], []
        pos = offset
        for k, tid in enumerate(token_ids):
            s = self.texts.text(tid)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
            top = tops[k] if tops is not None and k < len(tops) else None
            top_dicts.append({self.texts.text(t): v for t, v in top} if top else None)
        return {
            "tokens": tokens,
            "token_logprobs": list(lps),
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    def native_logprobs(self, pairs: Sequence[tuple[int, float | None]], with_text: bool) -> list[list]:
        return [[lp, tid, self.texts.text(tid) if with_text else None] for tid, lp in pairs]

    def native_tops(self, tops: Sequence[Sequence[tuple[int, float]]] | None, n: int,
                    with_text: bool) -> list[list | None]:
        if tops is None:
            return [None] * n
        return [
            [[v, t, self.texts.text(t) if with_text else None] for t, v in top] if top else None
            for top in tops
        ]

    # ---- waiting
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
            async for i, out in _merge(streams):
                if out.finished:
                    finals[i] = out
        finally:
            watcher.cancel()
            self.abort_unfinished(streams)
        return finals  # type: ignore[return-value]

    def abort_unfinished(self, streams: Sequence[RequestStream]) -> None:
        for s in streams:
            if not s.finished:
                self.bridge.abort_nowait(s.rid)


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    bridge: EngineBridge | None = None,
) -> FastAPI:
    """Build the app around ``engine``; the engine thread starts with the app (lifespan).

    Pass ``bridge`` to share one you already started (the app then leaves it running at
    shutdown); otherwise the app owns its bridge and stops it when the server stops.
    """
    metrics = ServerMetrics()

    def on_finish(stream: RequestStream, out: RequestOutput) -> None:
        metrics.observe_finished(out, stream.created)
        now = time.monotonic()
        ttft = (out.first_token_time - out.arrival_time) if out.first_token_time else None
        logger.info(
            "request %s finish=%s prompt=%r prompt_tokens=%d cached=%d generated=%d ttft=%s latency=%.3fs",
            out.request_id, out.finish_reason, stream.label, out.prompt_tokens,
            out.cached_tokens, len(out.token_ids),
            f"{ttft:.3f}s" if ttft is not None else "-", (out.finish_time or now) - stream.created,
        )

    owns_bridge = bridge is None
    if bridge is None:
        bridge = EngineBridge(engine, on_finish=on_finish)
    elif bridge.on_finish is None:
        bridge.on_finish = on_finish
    name = served_model_name or engine.config.model
    srv = _Server(engine, bridge, metrics, name)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        srv.bridge.start()
        try:
            yield
        finally:
            if owns_bridge:
                await asyncio.to_thread(srv.bridge.stop)

    app = FastAPI(title="radixserve", version=VERSION, lifespan=lifespan)
    app.state.server = srv
    app.state.bridge = bridge
    app.state.metrics = metrics
    _install_error_handlers(app)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    # ------------------------------------------------------------------ OpenAI
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{
                "id": srv.model_name,
                "object": "model",
                "created": srv.created,
                "owned_by": "radixserve",
                "root": engine.config.model,
                "max_model_len": srv.max_context_len,
            }],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        srv.check_model(body.model)
        prompts = body.prompts()
        ids_list = [srv.encode(p) for p in prompts]
        n = body.n
        base = f"cmpl-{uuid.uuid4().hex}"
        items, labels = [], []
        for pi, ids in enumerate(ids_list):
            for j in range(n):
                items.append((f"{base}-{pi}-{j}", ids, body.sampling_params(seed_offset=j)))
                labels.append(srv.label(prompts[pi]))
        streams = await bridge.submit(items, labels)
        model = body.model or srv.model_name
        created = int(time.time())
        want_lp = body.logprobs is not None

        def echo_text(i: int) -> str:
            p = prompts[i // n]
            return p if isinstance(p, str) else srv.tokenizer.decode(p)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def gen() -> AsyncIterator[str]:
                sent_lp = [0] * len(streams)
                offsets = [0] * len(streams)
                finals: list[RequestOutput | None] = [None] * len(streams)
                if body.echo:
                    for i in range(len(streams)):
                        t = echo_text(i)
                        offsets[i] = len(t)
                        yield _sse({"id": base, "object": "text_completion", "created": created,
                                    "model": model, "choices": [{"index": i, "text": t,
                                    "logprobs": None, "finish_reason": None}],
                                    **({"usage": None} if include_usage else {})})
                async for i, out in _merge(streams):
                    _raise_if_failed(out)
                    lp = None
                    if want_lp and out.logprobs is not None:
                        k0 = sent_lp[i]
                        lp = srv.completion_logprobs(
                            out.token_ids[k0:], out.logprobs[k0:],
                            out.top_logprobs[k0:] if out.top_logprobs else None, offsets[i])
                        sent_lp[i] = len(out.logprobs)
                    offsets[i] += len(out.delta_text)
                    if out.finished:
                        finals[i] = out
                    if not out.delta_text and not out.finished and lp is None:
                        continue
                    yield _sse({"id": base, "object": "text_completion", "created": created,
                                "model": model, "choices": [{"index": i, "text": out.delta_text,
                                "logprobs": lp, "finish_reason": _openai_finish(out)}],
                                **({"usage": None} if include_usage else {})})
                if include_usage:
                    yield _sse({"id": base, "object": "text_completion", "created": created,
                                "model": model, "choices": [],
                                "usage": _group_usage(finals, n)})  # type: ignore[arg-type]

            return _sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        choices = []
        for i, out in enumerate(finals):
            _raise_if_failed(out)
            text = out.text
            lp = None
            prefix = echo_text(i) if body.echo else ""
            if want_lp:
                if body.echo and out.prompt_logprobs is not None:
                    ptoks = [t for t, _ in out.prompt_logprobs]
                    plps = [v for _, v in out.prompt_logprobs]
                    ptops = out.prompt_top_logprobs if body.logprobs else None
                    lp_p = srv.completion_logprobs(ptoks, plps, ptops, 0)
                    lp_o = srv.completion_logprobs(out.token_ids, out.logprobs or [],
                                                   out.top_logprobs, len(prefix))
                    lp = {k: lp_p[k] + lp_o[k] for k in lp_p}
                else:
                    lp = srv.completion_logprobs(out.token_ids, out.logprobs or [],
                                                 out.top_logprobs, len(prefix))
            choices.append({"index": i, "text": prefix + text, "logprobs": lp,
                            "finish_reason": _openai_finish(out)})
        return {"id": base, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": _group_usage(finals, n)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        srv.check_model(body.model)
        msgs = body.template_messages()
        prompt_text = srv.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=body.add_generation_prompt and not body.continue_final_message
        )
        ids = srv.encode(prompt_text)
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            # OpenAI's default: as much as the context window leaves.
            max_tokens = max(0, srv.max_context_len - len(ids))
            if max_tokens == 0:
                raise APIError(400, f"the prompt has {len(ids)} tokens; the context length is "
                               f"{srv.max_context_len}", param="messages")
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        n = body.n
        base = f"chatcmpl-{uuid.uuid4().hex}"
        items = [(f"{base}-{j}", ids, body.sampling_params(max_tokens, seed_offset=j)) for j in range(n)]
        label = srv.label(msgs[-1].get("content", ""))
        streams = await bridge.submit(items, [label] * n)
        model = body.model or srv.model_name
        created = int(time.time())

        def chunk(choices: list[dict], usage: Any = ..., ) -> str:
            obj: dict[str, Any] = {"id": base, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "system_fingerprint": None, "choices": choices}
            if usage is not ...:
                obj["usage"] = usage
            return _sse(obj)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            usage_field: Any = None if include_usage else ...

            async def gen() -> AsyncIterator[str]:
                sent_lp = [0] * n
                finals: list[RequestOutput | None] = [None] * n
                for j in range(n):
                    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}], usage_field)
                async for j, out in _merge(streams):
                    _raise_if_failed(out)
                    lp = None
                    if body.logprobs and out.logprobs is not None and len(out.logprobs) > sent_lp[j]:
                        k0 = sent_lp[j]
                        lp = {"content": srv.chat_logprob_entries(
                            out.token_ids[k0:], out.logprobs[k0:],
                            out.top_logprobs[k0:] if out.top_logprobs else None), "refusal": None}
                        sent_lp[j] = len(out.logprobs)
                    if out.delta_text or lp is not None:
                        yield chunk([{"index": j, "delta": {"content": out.delta_text},
                                      "logprobs": lp, "finish_reason": None}], usage_field)
                    if out.finished:
                        finals[j] = out
                        yield chunk([{"index": j, "delta": {}, "logprobs": None,
                                      "finish_reason": _openai_finish(out)}], usage_field)
                if include_usage:
                    yield chunk([], _group_usage(finals, n))  # type: ignore[arg-type]

            return _sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        choices = []
        for j, out in enumerate(finals):
            _raise_if_failed(out)
            lp = None
            if body.logprobs:
                lp = {"content": srv.chat_logprob_entries(out.token_ids, out.logprobs or [],
                                                          out.top_logprobs), "refusal": None}
            choices.append({"index": j, "message": {"role": "assistant", "content": out.text},
                            "logprobs": lp, "finish_reason": _openai_finish(out)})
        return {"id": base, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": None, "choices": choices, "usage": _group_usage(finals, n)}

    # ------------------------------------------------------------------ SGLang native
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        prompts = body.prompts()
        batch = body.is_batch()
        size = len(prompts)
        items: list[tuple[str, list[int], SamplingParams]] = []
        labels: list[str] = []
        opts: list[dict[str, Any]] = []
        rid_base = uuid.uuid4().hex
        for i, p in enumerate(prompts):
            ids = srv.encode(p)
            sp = body.per_item("sampling_params", i, size) if isinstance(body.sampling_params, list) \
                else body.sampling_params
            if isinstance(body.sampling_params, list) and not batch:
                raise ValueError("sampling_params must be an object for a single prompt")
            ret_lp = body.per_item("return_logprob", i, size)
            start = body.per_item("logprob_start_len", i, size)
            topn = body.per_item("top_logprobs_num", i, size)
            if ret_lp and (start < 0 or start >= len(ids)):
                # SGLang's default: only the last prompt token.
                start = len(ids) - 1
            n = (sp or {}).get("n", 1) if isinstance(sp, dict) else 1
            if n is None:
                n = 1
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
                raise ValueError(f"sampling_params.n must be an integer in [1, 128], got {n!r}")
            rid = body.per_item("rid", i, size) if isinstance(body.rid, list) else body.rid
            for j in range(n):
                params = native_sampling_params(
                    sp, return_logprob=ret_lp, logprob_start_len=start, top_logprobs_num=topn,
                    seed_offset=j, vocab_size=engine.vocab_size,
                )
                r = rid if rid is not None and size == 1 and n == 1 else f"{rid or rid_base}-{i}-{j}"
                items.append((r, ids, params))
                labels.append(srv.label(p))
                opts.append({"return_logprob": ret_lp})
        streams = await bridge.submit(items, labels)
        with_text = body.return_text_in_logprobs

        def render(k: int, out: RequestOutput) -> dict[str, Any]:
            if out.finished:
                if out.finish_reason == "stop":
                    fr: Any = {"type": "stop", "matched": out.matched_stop}
                elif out.finish_reason == "length":
                    fr = {"type": "length", "length": len(out.token_ids)}
                elif out.finish_reason == "abort":
                    fr = {"type": "abort", "message": "aborted"}
                else:
                    fr = {"type": out.finish_reason or "error", "message": out.error}
            else:
                fr = None
            meta: dict[str, Any] = {
                "id": out.request_id,
                "finish_reason": fr,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": len(out.token_ids),
                "cached_tokens": out.cached_tokens,
                "e2e_latency": time.monotonic() - streams[k].created,
            }
            if opts[k]["return_logprob"]:
                pl = out.prompt_logprobs or []
                meta["input_token_logprobs"] = srv.native_logprobs(pl, with_text)
                meta["output_token_logprobs"] = srv.native_logprobs(
                    list(zip(out.token_ids, out.logprobs or [])), with_text)
                meta["input_top_logprobs"] = srv.native_tops(out.prompt_top_logprobs, len(pl), with_text)
                meta["output_top_logprobs"] = srv.native_tops(
                    out.top_logprobs, len(out.token_ids), with_text)
                vals = [v for _, v in pl if v is not None]
                meta["normalized_prompt_logprob"] = sum(vals) / len(vals) if vals else None
            return {"text": out.text, "output_ids": list(out.token_ids), "meta_info": meta}

        if body.stream:
            async def gen() -> AsyncIterator[str]:
                async for k, out in _merge(streams):
                    _raise_if_failed(out)
                    obj = render(k, out)
                    if batch or len(streams) > 1:
                        obj["index"] = k
                    yield _sse(obj)

            return _sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        for out in finals:
            _raise_if_failed(out)
        results = [render(k, out) for k, out in enumerate(finals)]
        if not batch and len(results) == 1:
            return results[0]
        return results

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        mc = engine.model_config
        return {
            "model_path": engine.config.model,
            "tokenizer_path": engine.config.model,
            "served_model_name": srv.model_name,
            "is_generation": True,
            "model_type": getattr(mc, "arch", None),
            "max_context_len": srv.max_context_len,
            "vocab_size": engine.vocab_size,
            "preferred_sampling_params": None,
            # Lets a frontend (radixserve.lang.RuntimeEndpoint) render role blocks exactly
            # as the model's own template does.
            "chat_template": engine.tokenizer.chat_template,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    async def server_info() -> dict[str, Any]:
        stats = await bridge.stats()
        cfg = dataclasses.asdict(engine.config)
        return {
            **cfg,
            "model_path": engine.config.model,
            "served_model_name": srv.model_name,
            "context_len": srv.max_context_len,
            "max_total_num_tokens": stats.get("kv_capacity_tokens"),
            "version": VERSION,
            "stats": stats,
            "internal_states": [stats],
        }

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])

    async def flush_cache(request: Request) -> Any:
        raw = await request.body()
        if raw.strip():
            try:
                FlushCacheRequest.model_validate_json(raw)
            except Exception as e:
                raise APIError(400, f"invalid flush_cache body: {e}") from None
        ok = await bridge.flush_cache()
        if not ok:
            stats = await bridge.stats()
            busy = stats.get("running_requests", 0) + stats.get("waiting_requests", 0)
            raise APIError(
                400,
                f"cannot flush the cache while requests are in flight ({busy} running or "
                "waiting); retry when the server is idle",
                code="server_busy",
            )
        return {"success": True, "message": "Cache flushed."}

    app.add_api_route("/flush_cache", flush_cache, methods=["POST", "GET"])

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> dict[str, Any]:
        return {"success": await bridge.abort(body.rid)}

    @app.get("/health")
    async def health() -> Response:
        # Liveness only: answered by the event loop, never waits for the engine.
        if not bridge.running:
            return error_response(503, "the engine thread is not running", "server_error")
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Readiness: one token through the engine (what SGLang's ``Runtime`` polls)."""
        rid = f"health-{uuid.uuid4().hex}"
        ids = [int(srv.tokenizer.bos_token_id or 0)]
        streams = await bridge.submit([(rid, ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                  ignore_eos=True))], ["<health>"])
        try:
            async for _ in streams[0]:
                pass
        finally:
            srv.abort_unfinished(streams)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        stats = await bridge.stats()
        return Response(metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        """Run the engine's invariant check (slot/lock accounting) between two steps."""
        try:
            stats = await bridge.check_integrity()
        except AssertionError as e:
            raise APIError(500, f"integrity check failed: {e}", "server_error") from None
        except (RuntimeError, ValueError) as e:
            raise APIError(500, f"integrity check failed: {type(e).__name__}: {e}", "server_error") from None
        return {"ok": True, "stats": stats}

    return app


__all__ = ["APIError", "create_app", "error_response"]
