"""SGLang's native API and the operational routes.

``/generate`` (text or token ids, batches, streaming, logprobs), ``/get_model_info`` and
``/model_info``, ``/server_info`` (``/get_server_info``), ``/flush_cache``,
``/abort_request``, ``/health``, ``/health_generate``, ``/metrics`` and
``/debug/integrity`` — shaped so that SGLang's frontend (``RuntimeEndpoint``) and SGLang's
router work unchanged.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from radixserve.request import RequestOutput
from radixserve.engine.client import EngineDeadError
from radixserve.images import ImageInput
from radixserve.sampling_params import SamplingParams
from radixserve.server.cache_hint import request_low_priority_from
from radixserve.server.errors import APIError, error_response, unavailable
from radixserve.server.images import check_count, no_images
from radixserve.server.limits import check_counts, check_name, check_stops
from radixserve.server.openapi import error_response_doc
from radixserve.server.auth import principal_of
from radixserve.server.openai_routes import raise_if_failed
from radixserve.protocol.native import (AbortRequest, FlushCacheRequest, GenerateRequest, native_sampling_params,
                                        native_session_id)
from radixserve.server.session_ids import request_session_id
from radixserve.server.sse import sse, sse_response
from radixserve.server.context import ServerState, merge
from radixserve.config import package_version

VERSION = package_version()
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "gemma3": "Gemma3ForCausalLM"}


def _architectures(arch: str | None, vision: bool) -> list[str] | None:
    if vision:
        return ["LlavaForConditionalGeneration"]
    return [_HF_ARCH[arch]] if arch in _HF_ARCH else None


def register(app: FastAPI, srv: ServerState, engine_config: Any) -> None:
    hide = srv.cfg.hide_cached_tokens

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Any:
        srv.check_ready()
        srv.check_model(body.model)
        body.check_neutral()
        prompts = body.prompts()
        batch = body.is_batch()
        size = len(prompts)
        if isinstance(body.sampling_params, list) and not batch:
            raise ValueError("sampling_params must be an object for a single prompt")
        if body.cache_salt is not None and not 0 < len(body.cache_salt) <= 256:
            raise APIError(400, "cache_salt must be a non-empty string of at most 256 characters",
                           param="cache_salt")
        refs = body.image_refs(size)
        vision = srv.vision
        if vision is None and any(refs):
            raise no_images(next(r for r in refs if r)[0][0])
        if any(refs):
            check_count(sum(len(r) for r in refs), srv.image_limits, "image_data")
        items: list[tuple[list[int], SamplingParams]] = []
        images: list[list[ImageInput]] = []
        labels: list[str] = []
        want_lp: list[bool] = []
        crids: list[str | None] = []
        sids: list[str | None] = []
        total = 0
        for i, p in enumerate(prompts):
            sp = body.per_item("sampling_params", i, size) if isinstance(body.sampling_params, list) \
                else body.sampling_params
            n = (sp or {}).get("n", 1) if isinstance(sp, dict) else 1
            n = 1 if n is None else n
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
                raise ValueError(f"sampling_params.n must be an integer in [1, 128], got {n!r}")
            total += n
            check_counts(size, 1, srv.cfg)
            check_counts(1, total, srv.cfg)
            if isinstance(sp, dict):
                check_stops(sp.get("stop"), sp.get("stop_token_ids"), srv.cfg, "sampling_params.stop",
                            "sampling_params.stop_token_ids")
            field = "text" if body.text is not None else "input_ids"
            ids = await srv.encode(p, field)
            if vision is not None:
                vision.check_placeholders(ids, len(refs[i]), f"{field}[{i}]" if batch else field)
            ims = await srv.load_images(refs[i], "image_data")
            ret_lp = body.per_item("return_logprob", i, size)
            start = body.per_item("logprob_start_len", i, size)
            topn = body.per_item("top_logprobs_num", i, size)
            if ret_lp and (start < 0 or start >= len(ids)):
                start = len(ids) - 1  # SGLang's default: only the last prompt token
            rid = body.per_item("rid", i, size) if isinstance(body.rid, list) else body.rid
            if rid is not None:
                check_name(rid, f"rid[{i}]" if isinstance(body.rid, list) else "rid")
            sess = body.per_item("session_params", i, size) if isinstance(body.session_params, list) \
                else body.session_params
            sid = request_session_id(request, native_session_id(sess), "session_params.id")
            for j in range(n):
                params = native_sampling_params(
                    sp, return_logprob=ret_lp, logprob_start_len=start, top_logprobs_num=topn,
                    seed_offset=j, vocab_size=srv.model.vocab_size)
                items.append((ids, params))
                images.append(ims)
                labels.append(srv.label(p))
                want_lp.append(ret_lp)
                crids.append(rid if rid is not None and n == 1 else None)
                sids.append(sid)
        await srv.check_grammars([p for _, p in items], prefix="sampling_params.")
        streams = srv.submit(principal_of(request), items, body.cache_salt, labels, "gen-", crids, sids,
                             images=images, low_priority_from=request_low_priority_from(request))
        names = [c or s.rid for c, s in zip(crids, streams)]
        with_text = body.return_text_in_logprobs

        def render(k: int, out: RequestOutput, text: str, ids: list[int], lps: Any, tops: Any,
                   prompt_lp: Any, prompt_tops: Any) -> dict:
            if out.finished:
                if out.finish_reason == "stop":
                    fr: Any = {"type": "stop", "matched": out.matched_stop}
                elif out.finish_reason == "length":
                    fr = {"type": "length", "length": len(ids)}
                elif out.finish_reason == "abort":
                    fr = {"type": "abort", "message": "aborted"}
                else:
                    fr = {"type": out.finish_reason or "error", "message": out.error}
            else:
                fr = None
            meta: dict[str, Any] = {
                "id": names[k], "finish_reason": fr, "prompt_tokens": out.prompt_tokens,
                "completion_tokens": len(ids), "cached_tokens": 0 if hide else out.cached_tokens,
                "e2e_latency": time.monotonic() - streams[k].created,
            }
            if out.draft_tokens:  # speculative decoding: SGLang's name for what was accepted
                meta["spec_accepted_tokens"] = out.accepted_draft_tokens
                meta["spec_draft_tokens"] = out.draft_tokens
            if out.cached_by_tier is not None and not hide:
                meta["cached_tokens_by_tier"] = out.cached_by_tier
                meta["uncached_tokens_by_reason"] = out.uncached_by_reason
            if want_lp[k]:
                pl = prompt_lp or []
                meta["input_token_logprobs"] = srv.texts.native_logprobs(pl, with_text)
                meta["output_token_logprobs"] = srv.texts.native_logprobs(list(zip(ids, lps or [])), with_text)
                meta["input_top_logprobs"] = srv.texts.native_tops(prompt_tops, len(pl), with_text)
                meta["output_top_logprobs"] = srv.texts.native_tops(tops, len(ids), with_text)
                vals = [v for _, v in pl if v is not None]
                meta["normalized_prompt_logprob"] = sum(vals) / len(vals) if vals else None
            return {"text": text, "output_ids": ids, "meta_info": meta}

        if body.stream:
            async def gen() -> AsyncIterator[str]:
                # SGLang streams cumulative text and ids per chunk.
                acc: list[dict[str, Any]] = [{"text": "", "ids": [], "lps": [], "tops": [],
                                              "prompt": (None, None)} for _ in streams]
                async for k, out in merge(streams):
                    raise_if_failed(out)
                    a = acc[k]
                    a["text"] += out.delta_text
                    a["ids"].extend(out.delta_token_ids)
                    if out.delta_logprobs:
                        a["lps"].extend(out.delta_logprobs)
                    if out.delta_top_logprobs:
                        a["tops"].extend(out.delta_top_logprobs)
                    if out.prompt_logprobs is not None:
                        a["prompt"] = (out.prompt_logprobs, out.prompt_top_logprobs)
                    obj = render(k, out, a["text"], list(a["ids"]), a["lps"], a["tops"] or None,
                                 *a["prompt"])
                    if batch or len(streams) > 1:
                        obj["index"] = k
                    yield sse(obj)

            return sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        for out in finals:
            raise_if_failed(out)
        results = [render(k, o, o.text, list(o.token_ids), o.logprobs, o.top_logprobs,
                          o.prompt_logprobs, o.prompt_top_logprobs) for k, o in enumerate(finals)]
        if not batch and len(results) == 1:
            return results[0]
        return results

    def model_info() -> dict[str, Any]:
        info = srv.info
        arch = info.arch if info is not None else None
        return {
            "model_path": srv.engine_model, "tokenizer_path": srv.engine_model,
            "served_model_name": srv.model_name, "is_generation": True,
            "model_type": arch, "max_context_len": srv.max_context_len,
            "vocab_size": info.vocab_size if info is not None else None, "preferred_sampling_params": None,
            # Lets a frontend (radixserve.lang.RuntimeEndpoint) render role blocks exactly
            # as /v1/chat/completions does (None: it refuses chat, see below).
            "chat_template": srv.chat_template.template, "weight_version": "default",
            # True when the model ships no template (a base model, most likely: better
            # prompted with raw text); chat then needs the server's --chat-template.
            "chat_template_builtin": srv.tokenizer.chat_template_builtin,
            "has_image_understanding": srv.vision is not None, "has_audio_understanding": False,
            "architectures": _architectures(arch, srv.vision is not None),
            # The image placeholder of prompts and the preprocessing (None: a text model).
            "vision": srv.vision.as_dict() if srv.vision is not None else None,
        }

    app.add_api_route("/get_model_info", model_info, methods=["GET"])
    # SGLang's router asks /model_info first (and falls back to the deprecated name).
    app.add_api_route("/model_info", model_info, methods=["GET"])

    async def server_info() -> dict[str, Any]:
        srv.check_ready()
        stats = await srv.client.call("stats")
        cfg = dataclasses.asdict(engine_config)
        return {**cfg, "model_path": srv.engine_model, "served_model_name": srv.model_name,
                "context_len": srv.max_context_len, "max_total_num_tokens": stats.get("kv_capacity_tokens"),
                "version": VERSION, "stats": stats, "internal_states": [stats]}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's load report (one entry per data-parallel rank), from the core's last step."""
        srv.check_ready()
        load = srv.client.load
        running, waiting, free = (load.running, load.waiting, load.kv_free_tokens) if load else (0, 0, 0)
        cap = srv.model.kv_capacity_tokens
        return [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                 "num_tokens": max(0, cap - free) if load else 0}]

    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Any:
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

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
        rid = srv.find(principal_of(request), body.rid)
        # The same answer for "not yours" and "does not exist": ids are not an oracle.
        return {"success": rid is not None and srv.client.abort(rid)}

    unavailable_doc = error_response_doc("The engine is starting, or gone (the message says why)")

    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine is ready (empty body)"}, 503: unavailable_doc})
    async def health() -> Response:
        # Liveness, answered by the event loop alone: never waits for the engine.
        if srv.client.dead_reason is not None:
            return error_response(503, f"the engine is not available: {srv.client.dead_reason}",
                                  "service_unavailable")
        if not srv.client.ready:
            return error_response(503, "the engine is starting", "service_unavailable")
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response, responses={
        200: {"description": "One token went through the engine (empty body)"}, 503: unavailable_doc})
    async def health_generate(request: Request) -> Response:
        """Readiness: one token through the engine (what SGLang's ``Runtime`` polls)."""
        srv.check_ready()
        ids = [int(srv.tokenizer.bos_token_id or 0)]
        streams = srv.submit(principal_of(request), [(ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                          ignore_eos=True))],
                             None, ["<health>"], "health-")
        try:
            async for _ in streams[0]:
                pass
        except EngineDeadError as e:
            raise unavailable(str(e)) from None
        finally:
            srv.abort_unfinished(streams)
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def metrics_endpoint() -> Response:
        stats: dict[str, Any] = {}
        if srv.client.alive:
            try:
                stats = await srv.client.call("stats", timeout=10)
            except (EngineDeadError, TimeoutError):
                stats = {}
        return Response(srv.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/integrity")
    async def integrity() -> dict[str, Any]:
        """Run the engine's invariant check (slot/lock accounting) between two steps."""
        srv.check_ready()
        try:
            stats = await srv.client.call("check_integrity")
        except AssertionError as e:
            raise APIError(500, f"integrity check failed: {e}", "server_error") from None
        return {"ok": True, "stats": stats}
