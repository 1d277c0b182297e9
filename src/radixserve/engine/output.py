"""From the core's token deltas to what a caller sees: text, stop strings, final results.

The engine core speaks token ids only. Whoever talks to users — the in-process
:class:`~radixserve.engine.engine.Engine` or the API process — runs one
:class:`OutputProcessor`: per request an incremental detokenizer and a stop-string checker,
and the accumulated result that the final :class:`~radixserve.request.RequestOutput` carries.

A stop string is found here, after the core generated the token that completed it, so
:meth:`OutputProcessor.process` returns the ids of requests that must be stopped in the core
(``Abort(reason="stop")``, which caches their KV like any finish); tokens the core produced
after the stop are ignored. A detokenizer failure fails that request alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from radixserve.request import RequestOutput
from radixserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from radixserve.engine.messages import ReqDelta
from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve.engine")


@dataclass
class _Track:
    rid: str
    params: SamplingParams
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    stopper: StopChecker
    arrival: float
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[tuple[int, float | None]] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    cached_tokens: int = 0
    first_token_time: float | None = None
    cached_by_tier: dict[str, int] | None = None
    uncached_by_reason: dict[str, int] | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def note(self, d: ReqDelta) -> None:
        """What the delta reports besides its tokens (cache, speculation, timing, prompt logprobs)."""
        self.cached_tokens = d.cached_tokens
        if d.draft_tokens:
            self.draft_tokens, self.accepted_draft_tokens = d.draft_tokens, d.accepted_draft_tokens
        if d.cached_by_tier is not None:
            self.cached_by_tier, self.uncached_by_reason = d.cached_by_tier, d.uncached_by_reason
        if d.first_token_time is not None and self.first_token_time is None:
            self.first_token_time = d.first_token_time
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = list(d.prompt_logprobs)
            self.prompt_top_logprobs = list(d.prompt_top_logprobs or [])

    def take_tokens(self, d: ReqDelta) -> tuple[str, list[int], str | int | None, str | None]:
        """Detokenize the delta's tokens up to a stop string: ``(text, tokens accepted, the
        stop, "stop" or None)``. A final stop token is accepted but shows no text."""
        text = ""
        accepted: list[int] = []
        last = len(d.new_token_ids) - 1
        for k, tok in enumerate(d.new_token_ids):
            accepted.append(tok)
            if d.finished and d.matched_stop is not None and k == last and tok == d.matched_stop:
                break
            res = self.stopper.feed(self.detok.add_token(tok), tok)
            text += res.text
            if res.stopped:
                return text, accepted, res.reason, "stop"
        return text, accepted, None, None

    def finish_text(self, d: ReqDelta) -> tuple[str, str | int | None, str]:
        """The core ended the request: ``(reason, the stop, the text held back till now)``.
        At the end of a stream the held-back text is released; it may complete a stop string."""
        reason, stopped, text = d.finish_reason or "stop", d.matched_stop, ""
        if reason in ("stop", "length"):
            res = self.stopper.feed(self.detok.flush())
            text = res.text
            if res.stopped:
                reason, stopped = "stop", res.reason
            else:
                text += self.stopper.flush()
        return reason, stopped, text


class OutputProcessor:
    """Detokenizes and stop-checks the outputs of every tracked request."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._tracks: dict[str, _Track] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._tracks

    def __len__(self) -> int:
        return len(self._tracks)

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams,
            arrival: float | None = None) -> None:
        detok = IncrementalDetokenizer(self.tokenizer.decode, prompt_ids_tail=prompt_ids[-8:],
                                       skip_special_tokens=params.skip_special_tokens)
        stopper = StopChecker(params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        self._tracks[rid] = _Track(rid, params, prompt_ids, detok, stopper, arrival or time.monotonic(),
                                   logprobs=[] if params.wants_logprobs else None,
                                   top_logprobs=[] if params.top_logprobs else None)

    def discard(self, rid: str) -> None:
        self._tracks.pop(rid, None)

    def fail(self, rid: str, reason: str, error: str | None) -> RequestOutput | None:
        """End a request here (abort, engine gone): its final output, or None if unknown."""
        t = self._tracks.pop(rid, None)
        return None if t is None else self._final(t, reason, None, error, [], None, None, time.monotonic())

    def process(self, deltas: Sequence[ReqDelta]) -> tuple[list[RequestOutput], list[str]]:
        """Outputs for the deltas of tracked requests, and the ids the core must stop."""
        outs: list[RequestOutput] = []
        stop: list[str] = []
        for d in deltas:
            t = self._tracks.get(d.rid)
            if t is None:
                continue  # already ended here (stop string, abort)
            try:
                o = self._apply(t, d)
            except Exception as e:  # a detokenizer bug fails this request, nobody else
                log.exception("output processing of %s failed", d.rid)
                self._tracks.pop(d.rid, None)
                o = self._final(t, "error", None, f"detokenization failed: {type(e).__name__}: {e}",
                                [], None, None, time.monotonic())
                if not d.finished:
                    stop.append(d.rid)
            if o is not None:
                outs.append(o)
                if o.finished and not d.finished:
                    stop.append(d.rid)
        return outs, stop

    def _apply(self, t: _Track, d: ReqDelta) -> RequestOutput | None:
        t.note(d)
        text, accepted, stopped, reason = t.take_tokens(d)
        lps = d.logprobs[: len(accepted)] if d.logprobs is not None else None
        tops = d.top_logprobs[: len(accepted)] if d.top_logprobs is not None else None
        t.token_ids.extend(accepted)
        if t.logprobs is not None and lps is not None:
            t.logprobs.extend(lps)
        if t.top_logprobs is not None and tops is not None:
            t.top_logprobs.extend(tops)
        if reason is None and d.finished:
            reason, stopped, tail = t.finish_text(d)
            text += tail
        if reason is not None:
            del self._tracks[t.rid]
            t.text += text
            return self._final(t, reason, stopped, d.error, accepted, lps, tops,
                               d.finish_time or time.monotonic(), delta_text=text)
        if not text and not accepted and d.prompt_logprobs is None:
            return None
        t.text += text
        return RequestOutput(
            request_id=t.rid, prompt_tokens=len(t.prompt_ids), cached_tokens=t.cached_tokens,
            delta_text=text, delta_token_ids=accepted, delta_logprobs=lps, delta_top_logprobs=tops,
            num_tokens=len(t.token_ids), arrival_time=t.arrival, first_token_time=t.first_token_time,
            prompt_logprobs=t.prompt_logprobs if d.prompt_logprobs is not None else None,
            prompt_top_logprobs=t.prompt_top_logprobs if d.prompt_logprobs is not None else None,
        )

    def _final(self, t: _Track, reason: str, matched: str | int | None, error: str | None,
               accepted: list[int], lps: list[float] | None, tops: Any, finish_time: float,
               delta_text: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=t.rid, prompt_tokens=len(t.prompt_ids), cached_tokens=t.cached_tokens,
            delta_text=delta_text, delta_token_ids=accepted, delta_logprobs=lps, delta_top_logprobs=tops,
            num_tokens=len(t.token_ids), finished=True, finish_reason=reason, matched_stop=matched,
            error=error, text=t.text, token_ids=t.token_ids, logprobs=t.logprobs,
            top_logprobs=t.top_logprobs, prompt_logprobs=t.prompt_logprobs,
            prompt_top_logprobs=t.prompt_top_logprobs, prompt_token_ids=t.prompt_ids,
            arrival_time=t.arrival, first_token_time=t.first_token_time, finish_time=finish_time,
            cached_by_tier=t.cached_by_tier, uncached_by_reason=t.uncached_by_reason,
            draft_tokens=t.draft_tokens, accepted_draft_tokens=t.accepted_draft_tokens,
        )
