"""OpenAI's response shapes: ``text_completion`` and ``chat.completion`` bodies, and their
SSE chunks, from the outputs of a request's choices (:class:`~radixserve.server.pipeline.Renderer`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from radixserve.request import RequestOutput
from radixserve.engine.async_client import RequestStream
from radixserve.grammar.tools import ToolCallStream, parse_tool_calls
from radixserve.protocol.openai import ChatCompletionRequest, CompletionRequest
from radixserve.protocol.tool_plan import ToolPlan
from radixserve.server.pipeline import merge, raise_if_failed
from radixserve.server.render import TokenText, group_usage, openai_finish, shown_logprobs
from radixserve.server.sse import sse

__all__ = ["ChatRender", "CompletionRender"]


class _OpenAIRender:
    """What both shapes share: the response id, model, creation time and usage block."""

    object = ""  # the chunks' "object"
    extra: dict[str, Any] = {}  # keys every body and chunk carries beside the common ones

    def __init__(self, srv: Any, body: CompletionRequest | ChatCompletionRequest,
                 streams: list[RequestStream], prefix: str):
        self.texts: TokenText = srv.texts
        self.streams = streams
        self.n = body.n
        self.base = prefix + streams[0].rid.split("-")[1]
        self.model = body.model or srv.model_name
        self.created = int(time.time())
        self.hide_cached = srv.cfg.hide_cached_tokens
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.base, "object": kind, "created": self.created, "model": self.model, **self.extra}

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        obj = {**self.head(self.object), "choices": choices}
        if self.include_usage:
            obj["usage"] = usage
        return sse(obj)

    def usage(self, finals: Sequence[RequestOutput | None]) -> dict[str, Any]:
        return group_usage(finals, self.n, self.hide_cached)  # type: ignore[arg-type]


class CompletionRender(_OpenAIRender):
    """``/v1/completions``: text per choice, completion-style logprobs, ``echo``."""

    object = "text_completion"

    def __init__(self, srv: Any, body: CompletionRequest, streams: list[RequestStream],
                 prompts: list[str | list[int]]):
        super().__init__(srv, body, streams, "cmpl-")
        self.body = body
        self.prompts = prompts
        self.tokenizer = srv.tokenizer

    def echo_text(self, i: int) -> str:
        p = self.prompts[i // self.n]
        return p if isinstance(p, str) else self.tokenizer.decode(p)

    def _choice(self, i: int, text: str, lp: Any, finish: str | None) -> dict[str, Any]:
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    async def stream(self) -> AsyncIterator[str]:
        offsets = [0] * len(self.streams)
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        if self.body.echo:
            for i in range(len(self.streams)):
                t = self.echo_text(i)
                offsets[i] = len(t)
                yield self.chunk([self._choice(i, t, None, None)])
        async for i, out in merge(self.streams):
            raise_if_failed(out)
            ids, lps, tops = shown_logprobs(out, out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
            lp = (self.texts.completion_logprobs(ids, lps, tops, offsets[i])
                  if self.body.logprobs is not None and lps else None)
            offsets[i] += len(out.delta_text)
            if out.finished:
                finals[i] = out
            if out.delta_text or out.finished or lp is not None:
                yield self.chunk([self._choice(i, out.delta_text, lp, openai_finish(out))])
        if self.include_usage:
            yield self.chunk([], self.usage(finals))

    def final(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.echo_text(i) if self.body.echo else ""
            lp = self._logprobs(out, prefix) if self.body.logprobs is not None else None
            choices.append(self._choice(i, prefix + out.text, lp, openai_finish(out)))
        return {**self.head(self.object), "choices": choices, "usage": self.usage(finals)}

    def _logprobs(self, out: RequestOutput, prefix: str) -> dict[str, Any]:
        lp = self.texts.completion_logprobs(*shown_logprobs(out, out.token_ids, out.logprobs, out.top_logprobs),
                                            len(prefix))
        if self.body.echo and out.prompt_logprobs is not None:
            pl = out.prompt_logprobs
            lp_p = self.texts.completion_logprobs([t for t, _ in pl], [v for _, v in pl],
                                                  out.prompt_top_logprobs if self.body.logprobs else None, 0)
            lp = {k: lp_p[k] + lp[k] for k in lp_p}
        return lp


class ChatRender(_OpenAIRender):
    """``/v1/chat/completions``: assistant messages, chat logprobs, tool calls."""

    object = "chat.completion.chunk"
    extra = {"system_fingerprint": None}

    def __init__(self, srv: Any, body: ChatCompletionRequest, streams: list[RequestStream], plan: ToolPlan | None):
        super().__init__(srv, body, streams, "chatcmpl-")
        self.logprobs = body.logprobs
        self.plan = plan

    async def stream(self) -> AsyncIterator[str]:
        finals: list[RequestOutput | None] = [None] * self.n
        calls = [ToolCallStream(self.plan.names) for _ in range(self.n)] if self.plan is not None else None
        for j in range(self.n):
            yield self.chunk([_delta(j, {"role": "assistant", "content": ""})])
        async for j, out in merge(self.streams):
            raise_if_failed(out)
            for c in self._deltas(j, out, calls[j] if calls is not None else None):
                yield self.chunk([c])
            if out.finished:
                finals[j] = out
        if self.include_usage:
            yield self.chunk([], self.usage(finals))

    def _deltas(self, j: int, out: RequestOutput, calls: ToolCallStream | None) -> list[dict[str, Any]]:
        """The chunks' choices for one output: text (and logprobs), tool calls, the finish."""
        ids, lps, tops = shown_logprobs(out, out.delta_token_ids, out.delta_logprobs, out.delta_top_logprobs)
        lp = {"content": self.texts.chat_entries(ids, lps, tops), "refusal": None} if self.logprobs and lps else None
        text, tool_deltas = out.delta_text, []
        if calls is not None:
            text, tool_deltas = calls.feed(text)
            if out.finished:
                text += calls.finish()
        deltas = []
        if text or lp is not None:
            deltas.append(_delta(j, {"content": text}, lp))
        if tool_deltas:
            deltas.append(_delta(j, {"tool_calls": tool_deltas}))
        if out.finished:
            made_calls = calls is not None and bool(calls.calls)
            deltas.append(_delta(j, {}, finish="tool_calls" if made_calls else openai_finish(out)))
        return deltas

    def final(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for j, out in enumerate(finals):
            shown = shown_logprobs(out, out.token_ids, out.logprobs, out.top_logprobs)
            lp = {"content": self.texts.chat_entries(*shown), "refusal": None} if self.logprobs else None
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish = openai_finish(out)
            if self.plan is not None:
                content, calls = parse_tool_calls(out.text, self.plan.names)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.as_openai() for c in calls]}
                    finish = "tool_calls"
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": finish})
        return {**self.head("chat.completion"), "choices": choices, "usage": self.usage(finals)}


def _delta(j: int, delta: dict[str, Any], lp: Any = None, finish: str | None = None) -> dict[str, Any]:
    return {"index": j, "delta": delta, "logprobs": lp, "finish_reason": finish}
