"""The operational routes, in SGLang's shapes: ``/get_model_info`` and ``/model_info``,
``/server_info`` (``/get_server_info``), ``/get_load``, ``/flush_cache``, ``/abort_request``,
``/health``, ``/health_generate``, ``/metrics`` and ``/debug/integrity``."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from radixserve.config import package_version
from radixserve.engine.client import EngineDeadError
from radixserve.protocol.native import AbortRequest, FlushCacheRequest, ServedModelInfo
from radixserve.sampling_params import SamplingParams
from radixserve.server.auth import principal_of
from radixserve.server.context import ServerContext
from radixserve.server.errors import APIError, error_response, unavailable
from radixserve.server.openapi import error_response_doc
from radixserve.server.pipeline import Choices

__all__ = ["VERSION", "OpsRoutes"]

VERSION = package_version()
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _architectures(arch: str | None, vision: bool) -> list[str] | None:
    if vision:
        return ["LlavaForConditionalGeneration"]
    return [_HF_ARCH[arch]] if arch in _HF_ARCH else None


class OpsRoutes:
    """What operators, SGLang's router and health checkers ask a server."""

    def __init__(self, srv: ServerContext, engine_config: Any):
        self.srv = srv
        self.engine_config = engine_config

    def register(self, app: FastAPI) -> None:
        get, unavailable_doc = ["GET"], error_response_doc("The engine is starting, or gone (the message says why)")
        app.add_api_route("/get_model_info", self.model_info, methods=get)
        # SGLang's router asks /model_info first (and falls back to the deprecated name).
        app.add_api_route("/model_info", self.model_info, methods=get)
        app.add_api_route("/get_load", self.get_load, methods=get)
        app.add_api_route("/server_info", self.server_info, methods=get)
        app.add_api_route("/get_server_info", self.server_info, methods=get)
        app.add_api_route("/flush_cache", self.flush_cache, methods=["POST"])
        app.add_api_route("/abort_request", self.abort_request, methods=["POST"])
        app.add_api_route("/health", self.health, methods=get, response_class=Response, responses={
            200: {"description": "The engine is ready (empty body)"}, 503: unavailable_doc})
        app.add_api_route("/health_generate", self.health_generate, methods=get, response_class=Response,
                          responses={200: {"description": "One token went through the engine (empty body)"},
                                     503: unavailable_doc})
        app.add_api_route("/metrics", self.metrics_endpoint, methods=get, response_class=PlainTextResponse,
                          responses={200: {"description": "Prometheus text format",
                                           "content": {"text/plain": {}}}})
        app.add_api_route("/debug/integrity", self.integrity, methods=get)

    def model_info(self) -> dict[str, Any]:
        srv = self.srv
        info, vision = srv.info, srv.vision
        arch = info.arch if info is not None else None
        return ServedModelInfo(
            model_path=srv.engine_model, tokenizer_path=srv.engine_model, served_model_name=srv.model_name,
            model_type=arch, max_context_len=srv.max_context_len,
            vocab_size=info.vocab_size if info is not None else None,
            chat_template=srv.chat_template.template, chat_template_builtin=srv.tokenizer.chat_template_builtin,
            has_image_understanding=vision is not None, architectures=_architectures(arch, vision is not None),
            vision=vision.spec() if vision is not None else None,
        ).as_json()

    async def server_info(self) -> dict[str, Any]:
        srv = self.srv
        srv.check_ready()
        stats = await srv.client.call("stats")
        return {**dataclasses.asdict(self.engine_config), "model_path": srv.engine_model,
                "served_model_name": srv.model_name, "context_len": srv.max_context_len,
                "max_total_num_tokens": stats.get("kv_capacity_tokens"),
                "version": VERSION, "stats": stats, "internal_states": [stats]}

    async def get_load(self) -> list[dict[str, Any]]:
        """SGLang's load report (one entry per data-parallel rank), from the core's last step."""
        srv = self.srv
        srv.check_ready()
        load = srv.client.load
        running, waiting, free = (load.running, load.waiting, load.kv_free_tokens) if load else (0, 0, 0)
        cap = srv.model.kv_capacity_tokens
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": max(0, cap - free) if load else 0}]

    async def flush_cache(self, request: Request) -> Any:
        srv = self.srv
        srv.check_ready()
        raw = await request.body()
        if raw.strip():
            try:
                FlushCacheRequest.model_validate_json(raw)
            except Exception as e:
                raise APIError(400, f"invalid flush_cache body: {e}") from None
        if not await srv.client.call("flush_cache"):
            load = srv.client.load
            busy = (load.running + load.waiting) if load else 0
            raise APIError(400, f"cannot flush the cache while requests are in flight ({busy} running "
                           "or waiting); retry when the server is idle", code="server_busy")
        return {"success": True, "message": "Cache flushed."}

    async def abort_request(self, body: AbortRequest, request: Request) -> dict[str, Any]:
        rid = self.srv.find(principal_of(request), body.rid)
        # The same answer for "not yours" and "does not exist": ids are not an oracle.
        return {"success": rid is not None and self.srv.client.abort(rid)}

    async def health(self) -> Response:
        # Liveness, answered by the event loop alone: never waits for the engine.
        client = self.srv.client
        if client.dead_reason is not None:
            return error_response(503, f"the engine is not available: {client.dead_reason}", "service_unavailable")
        if not client.ready:
            return error_response(503, "the engine is starting", "service_unavailable")
        return Response(status_code=200)

    async def health_generate(self, request: Request) -> Response:
        """Readiness: one token through the engine (what SGLang's ``Runtime`` polls)."""
        srv = self.srv
        srv.check_ready()
        choices = Choices()
        choices.add([int(srv.tokenizer.bos_token_id or 0)],
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), "<health>")
        streams = srv.submit(request, choices, None, "health-")
        try:
            async for _ in streams[0]:
                pass
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        finally:
            srv.abort_unfinished(streams)
        return Response(status_code=200)

    async def metrics_endpoint(self) -> Response:
        srv = self.srv
        stats: dict[str, Any] = {}
        if srv.client.alive:
            with contextlib.suppress(EngineDeadError, TimeoutError):
                stats = await srv.client.call("stats", timeout=10)
        return Response(srv.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def integrity(self) -> dict[str, Any]:
        """Run the engine's invariant check (slot/lock accounting) between two steps."""
        srv = self.srv
        srv.check_ready()
        try:
            stats = await srv.client.call("check_integrity")
        except AssertionError as e:
            raise APIError(500, f"integrity check failed: {e}", "server_error") from None
        return {"ok": True, "stats": stats}
