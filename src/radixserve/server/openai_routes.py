"""OpenAI API: ``/v1/completions``, ``/v1/chat/completions`` (SSE, n > 1, logprobs), ``/v1/models``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request

from radixserve.request import RequestOutput
from radixserve.grammar.tools import ToolCallStream, parse_tool_calls
from radixserve.server.auth import principal_of
from radixserve.server.cache_hint import request_low_priority_from
from radixserve.server.errors import APIError
from radixserve.server.images import check_count, no_images
from radixserve.server.limits import check_counts, check_stops
from radixserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from radixserve.server.render import group_usage, openai_finish, shown_logprobs
from radixserve.server.session_ids import request_session_id
from radixserve.server.sse import sse, sse_response
from radixserve.server.context import ServerState, merge


def raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        # A request the engine could not run (e.g. prompt + max_tokens larger than the KV
        # pool, or its sampling produced no valid distribution): a property of the request.
        raise APIError(400, out.error or "the request failed", code="request_failed")


def register(app: FastAPI, srv: ServerState) -> None:
    hide = srv.cfg.hide_cached_tokens

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "radixserve",
            "root": srv.engine_model, "max_model_len": srv.max_context_len,
        }]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        srv.check_ready()
        srv.check_model(body.model)
        prompts = body.prompts()
        n = body.n
        check_counts(len(prompts), n, srv.cfg)
        check_stops(body.stop, body.stop_token_ids, srv.cfg)
        if body.cache_salt is not None:
            _check_salt(body.cache_salt)
        session = request_session_id(request, body.session_id)
        prediction = await srv.encode_prediction(body.prediction)
        params = [body.sampling_params(seed_offset=j, prediction=prediction) for j in range(n)]
        await srv.check_grammars(params, grammar_field(body))
        ids_list = [await srv.encode(p, "prompt") for p in prompts]
        if srv.vision is not None:  # no images here: "<image>" in the text cannot be served
            for ids in ids_list:
                srv.vision.check_placeholders(ids, 0, "prompt")
        items = [(ids, params[j]) for ids in ids_list for j in range(n)]
        labels = [srv.label(prompts[i // n]) for i in range(len(items))]
        streams = srv.submit(principal_of(request), items, body.cache_salt, labels, "cmpl-",
                             session_ids=[session] * len(items),
                             low_priority_from=request_low_priority_from(request))
        base = "cmpl-" + streams[0].rid.split("-")[1]
        model = body.model or srv.model_name
        created = int(time.time())
        want_lp = body.logprobs is not None

        def echo_text(i: int) -> str:
            p = prompts[i // n]
            return p if isinstance(p, str) else srv.tokenizer.decode(p)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if include_usage else {}

            async def gen() -> AsyncIterator[str]:
                offsets = [0] * len(streams)
                finals: list[RequestOutput | None] = [None] * len(streams)
                if body.echo:
                    for i in range(len(streams)):
                        t = echo_text(i)
                        offsets[i] = len(t)
                        yield sse({"id": base, "object": "text_completion", "created": created,
                                   "model": model, "choices": [{"index": i, "text": t, "logprobs": None,
                                                                "finish_reason": None}], **extra})
                async for i, out in merge(streams):
                    raise_if_failed(out)
                    lp = None
                    ids, lps, tops = shown_logprobs(out, out.delta_token_ids, out.delta_logprobs,
                                                    out.delta_top_logprobs)
                    if want_lp and lps:
                        lp = srv.texts.completion_logprobs(ids, lps, tops, offsets[i])
                    offsets[i] += len(out.delta_text)
                    if out.finished:
                        finals[i] = out
                    if not out.delta_text and not out.finished and lp is None:
                        continue
                    yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                               "choices": [{"index": i, "text": out.delta_text, "logprobs": lp,
                                            "finish_reason": openai_finish(out)}], **extra})
                if include_usage:
                    yield sse({"id": base, "object": "text_completion", "created": created, "model": model,
                               "choices": [], "usage": group_usage(finals, n, hide)})  # type: ignore[arg-type]

            return sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        choices = []
        for i, out in enumerate(finals):
            raise_if_failed(out)
            prefix = echo_text(i) if body.echo else ""
            lp = None
            if want_lp:
                lp = srv.texts.completion_logprobs(*shown_logprobs(out, out.token_ids, out.logprobs,
                                                                   out.top_logprobs), len(prefix))
                if body.echo and out.prompt_logprobs is not None:
                    pl = out.prompt_logprobs
                    lp_p = srv.texts.completion_logprobs([t for t, _ in pl], [v for _, v in pl],
                                                         out.prompt_top_logprobs if body.logprobs else None, 0)
                    lp = {k: lp_p[k] + lp[k] for k in lp_p}
            choices.append({"index": i, "text": prefix + out.text, "logprobs": lp,
                            "finish_reason": openai_finish(out)})
        return {"id": base, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": group_usage(finals, n, hide)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        srv.check_ready()
        srv.check_model(body.model)
        n = body.n
        check_counts(1, n, srv.cfg)
        check_stops(body.stop, body.stop_token_ids, srv.cfg)
        if body.cache_salt is not None:
            _check_salt(body.cache_salt)
        session = request_session_id(request, body.session_id)
        vision = srv.vision
        refs = body.image_refs()
        if refs and vision is None:
            raise no_images(refs[0][0])
        if refs:
            check_count(len(refs), srv.image_limits, "messages")
        msgs = body.template_messages(vision.image_token if vision is not None else None)
        plan = body.tool_plan()
        prompt_text = await srv.chat_prompt(
            msgs, body.add_generation_prompt and not body.continue_final_message,
            tools=plan.openai_tools() if plan is not None else None)
        ids = await srv.encode(prompt_text, "messages", chat=True)
        prompt_len = len(ids)
        if vision is not None:
            # Also without images: "<image>" typed as text would be a placeholder.
            vision.check_placeholders(ids, len(refs), "messages")
            prompt_len = vision.prompt_len(ids, len(refs))
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            # OpenAI's default: as much as the context window leaves.
            max_tokens = max(0, srv.max_context_len - prompt_len)
            if max_tokens == 0:
                raise APIError(400, f"the prompt has {prompt_len} tokens; the context length is "
                               f"{srv.max_context_len}", param="messages")
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        prediction = await srv.encode_prediction(body.prediction)
        items = [(ids, body.sampling_params(max_tokens, seed_offset=j, plan=plan, prediction=prediction))
                 for j in range(n)]
        await srv.check_grammars([p for _, p in items],
                                 "tools" if plan is not None and plan.grammar else grammar_field(body))
        images = await srv.load_images(refs, "messages")
        label = srv.label(msgs[-1].get("content", ""))
        streams = srv.submit(principal_of(request), items, body.cache_salt, [label] * n, "chatcmpl-",
                             session_ids=[session] * n, images=[images] * n,
                             low_priority_from=request_low_priority_from(request))
        base = "chatcmpl-" + streams[0].rid.split("-")[1]
        model = body.model or srv.model_name
        created = int(time.time())

        def chunk(choices: list[dict], usage: Any = ...) -> str:
            obj: dict[str, Any] = {"id": base, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "system_fingerprint": None, "choices": choices}
            if usage is not ...:
                obj["usage"] = usage
            return sse(obj)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            usage_field: Any = None if include_usage else ...

            async def gen() -> AsyncIterator[str]:
                finals: list[RequestOutput | None] = [None] * n
                calls = [ToolCallStream(plan.names) for _ in range(n)] if plan is not None else None
                for j in range(n):
                    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}], usage_field)
                async for j, out in merge(streams):
                    raise_if_failed(out)
                    lp = None
                    ids, lps, tops = shown_logprobs(out, out.delta_token_ids, out.delta_logprobs,
                                                    out.delta_top_logprobs)
                    if body.logprobs and lps:
                        lp = {"content": srv.texts.chat_entries(ids, lps, tops), "refusal": None}
                    text, tool_deltas = out.delta_text, []
                    if calls is not None:
                        text, tool_deltas = calls[j].feed(text)
                        if out.finished:
                            text += calls[j].finish()
                    if text or lp is not None:
                        yield chunk([{"index": j, "delta": {"content": text}, "logprobs": lp,
                                      "finish_reason": None}], usage_field)
                    if tool_deltas:
                        yield chunk([{"index": j, "delta": {"tool_calls": tool_deltas}, "logprobs": None,
                                      "finish_reason": None}], usage_field)
                    if out.finished:
                        finals[j] = out
                        made_calls = calls is not None and bool(calls[j].calls)
                        yield chunk([{"index": j, "delta": {}, "logprobs": None,
                                      "finish_reason": "tool_calls" if made_calls else openai_finish(out)}],
                                    usage_field)
                if include_usage:
                    yield chunk([], group_usage(finals, n, hide))  # type: ignore[arg-type]

            return sse_response(gen(), srv, streams)

        finals = await srv.wait_all(streams, request)
        choices = []
        for j, out in enumerate(finals):
            raise_if_failed(out)
            lp = None
            if body.logprobs:
                lp = {"content": srv.texts.chat_entries(*shown_logprobs(out, out.token_ids, out.logprobs,
                                                                        out.top_logprobs)),
                      "refusal": None}
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish = openai_finish(out)
            if plan is not None:
                content, calls = parse_tool_calls(out.text, plan.names)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.as_openai() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": finish})
        return {"id": base, "object": "chat.completion", "created": created, "model": model,
                "system_fingerprint": None, "choices": choices, "usage": group_usage(finals, n, hide)}


def grammar_field(body: Any) -> str | None:
    """The request field a body's grammar came from (for a 400's ``param``)."""
    given = body.grammar_kwargs()
    if "json_schema" in given:
        return "response_format"
    return next(iter(given), None)


def _check_salt(salt: str) -> None:
    if not salt or len(salt) > 256:
        raise APIError(400, "cache_salt must be a non-empty string of at most 256 characters",
                       param="cache_salt")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "cache_salt is not valid Unicode", param="cache_salt") from None


__all__ = ["register", "raise_if_failed"]
