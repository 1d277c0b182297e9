"""SGLang's ``/generate`` response shape: ``{"text", "output_ids", "meta_info"}`` per choice,
streamed cumulatively (each chunk holds everything so far, as SGLang streams)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.request import RequestOutput
from radixserve.engine.async_client import RequestStream
from radixserve.server.pipeline import merge, raise_if_failed
from radixserve.server.render import TokenText
from radixserve.server.sse import sse

__all__ = ["GenerateRender", "native_finish"]


def native_finish(out: RequestOutput, completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's ``finish_reason`` object (None while the request runs)."""
    if not out.finished:
        return None
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.matched_stop}
    if out.finish_reason == "length":
        return {"type": "length", "length": completion_tokens}
    if out.finish_reason == "abort":
        return {"type": "abort", "message": "aborted"}
    return {"type": out.finish_reason or "error", "message": out.error}


@dataclass
class _Sofar:
    """One choice's output so far (SGLang streams cumulative text and ids)."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tops: list[Any] = field(default_factory=list)
    prompt: tuple[Any, Any] = (None, None)

    def add(self, out: RequestOutput) -> None:
        self.text += out.delta_text
        self.ids.extend(out.delta_token_ids)
        self.lps.extend(out.delta_logprobs or ())
        self.tops.extend(out.delta_top_logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt = (out.prompt_logprobs, out.prompt_top_logprobs)


class GenerateRender:
    """``/generate``'s answer for the choices of one request (a :class:`Renderer`)."""

    def __init__(self, texts: TokenText, streams: list[RequestStream], names: list[str],
                 want_logprobs: list[bool], with_text: bool, batch: bool, hide_cached: bool):
        self.texts = texts
        self.streams = streams
        self.names = names  # the client's rid, else ours
        self.want_logprobs = want_logprobs
        self.with_text = with_text
        self.indexed = batch or len(streams) > 1
        self.hide_cached = hide_cached

    async def stream(self) -> AsyncIterator[str]:
        sofar = [_Sofar() for _ in self.streams]
        async for k, out in merge(self.streams):
            raise_if_failed(out)
            a = sofar[k]
            a.add(out)
            obj = self.render(k, out, a.text, list(a.ids), a.lps, a.tops or None, *a.prompt)
            if self.indexed:
                obj["index"] = k
            yield sse(obj)

    def final(self, finals: list[RequestOutput]) -> Any:
        results = [self.render(k, o, o.text, list(o.token_ids), o.logprobs, o.top_logprobs,
                               o.prompt_logprobs, o.prompt_top_logprobs) for k, o in enumerate(finals)]
        return results if self.indexed else results[0]

    def render(self, k: int, out: RequestOutput, text: str, ids: list[int], lps: Any, tops: Any,
               prompt_lp: Any, prompt_tops: Any) -> dict[str, Any]:
        hide = self.hide_cached
        meta: dict[str, Any] = {
            "id": self.names[k], "finish_reason": native_finish(out, len(ids)), "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(ids), "cached_tokens": 0 if hide else out.cached_tokens,
            "e2e_latency": time.monotonic() - self.streams[k].created,
        }
        if out.draft_tokens:  # speculative decoding: SGLang's name for what was accepted
            meta["spec_accepted_tokens"] = out.accepted_draft_tokens
            meta["spec_draft_tokens"] = out.draft_tokens
        if out.cached_by_tier is not None and not hide:
            meta["cached_tokens_by_tier"] = out.cached_by_tier
            meta["uncached_tokens_by_reason"] = out.uncached_by_reason
        if self.want_logprobs[k]:
            meta.update(self._logprobs(ids, lps, tops, prompt_lp or [], prompt_tops))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _logprobs(self, ids: list[int], lps: Any, tops: Any, pl: list, prompt_tops: Any) -> dict[str, Any]:
        t, with_text = self.texts, self.with_text
        vals = [v for _, v in pl if v is not None]
        return {"input_token_logprobs": t.native_logprobs(pl, with_text),
                "output_token_logprobs": t.native_logprobs(list(zip(ids, lps or [])), with_text),
                "input_top_logprobs": t.native_tops(prompt_tops, len(pl), with_text),
                "output_top_logprobs": t.native_tops(tops, len(ids), with_text),
                "normalized_prompt_logprob": sum(vals) / len(vals) if vals else None}
