"""Shapes of the responses: usage blocks, logprobs in OpenAI's and SGLang's forms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.request import RequestOutput
from radixserve.model.tokenization.gguf_tokenizer import bytes_to_unicode


class TokenText:
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

    # ---- OpenAI shapes
    def chat_entries(self, token_ids: Sequence[int], lps: Sequence[float],
                     tops: Sequence[Sequence[tuple[int, float]]] | None) -> list[dict]:
        entries = []
        for k, (tid, lp) in enumerate(zip(token_ids, lps)):
            top = tops[k] if tops is not None and k < len(tops) else []
            entries.append({
                "token": self.text(tid), "logprob": lp, "bytes": list(self.bytes(tid)),
                "top_logprobs": [{"token": self.text(t), "logprob": v, "bytes": list(self.bytes(t))}
                                 for t, v in top],
            })
        return entries

    def completion_logprobs(self, token_ids: Sequence[int], lps: Sequence[float | None],
                            tops: Sequence[Sequence[tuple[int, float]]] | None, offset: int) -> dict[str, Any]:
        tokens, offsets, top_dicts = [], [], []
        pos = offset
        for k, tid in enumerate(token_ids):
            s = self.text(tid)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
            top = tops[k] if tops is not None and k < len(tops) else None
            top_dicts.append({self.text(t): v for t, v in top} if top else None)
        return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top_dicts, "text_offset": offsets}

    # ---- SGLang shapes
    def native_logprobs(self, pairs: Sequence[tuple[int, float | None]], with_text: bool) -> list[list]:
        return [[lp, tid, self.text(tid) if with_text else None] for tid, lp in pairs]

    def native_tops(self, tops: Sequence[Sequence[tuple[int, float]]] | None, n: int,
                    with_text: bool) -> list[list | None]:
        if tops is None:
            return [None] * n
        return [[[v, t, self.text(t) if with_text else None] for t, v in top] if top else None for top in tops]


def shown_logprobs(out: RequestOutput, token_ids: Sequence[int], lps: Sequence[float] | None,
                   tops: Sequence[Any] | None) -> tuple[Sequence[int], Sequence[float], Sequence[Any] | None]:
    """The tokens, logprobs and top alternatives of the text a client is shown: without the
    stop token (end of turn, EOS, a ``stop_token_ids`` entry) that ended the request, whose
    text is never part of the output. Usage still counts that token, as vLLM's does.
    ``token_ids`` etc. are the final output's or, streamed, the last delta's."""
    lps = lps or []
    stop = out.matched_stop
    if (out.finished and isinstance(stop, int) and not isinstance(stop, bool) and token_ids
            and token_ids[-1] == stop):
        n = len(token_ids) - 1
        return token_ids[:n], lps[:n], tops[:n] if tops is not None else None
    return token_ids, lps, tops


def group_usage(finals: Sequence[RequestOutput], n: int, hide_cached: bool) -> dict[str, Any]:
    """OpenAI's usage object of a request fanned out to ``n`` choices per prompt: prompt tokens
    count once per prompt (OpenAI's convention for n > 1), cached tokens are the most any
    choice of that prompt took from the cache, completion tokens are summed. Speculative
    decoding's draft tokens are reported under the names OpenAI's Predicted Outputs use:
    accepted ones are part of the completion, rejected ones were computed and dropped
    (neither is counted twice in ``completion_tokens``)."""
    prompt = cached = completion = 0
    for g in range(0, len(finals), n):
        group = finals[g : g + n]
        prompt += group[0].prompt_tokens
        cached += max(o.cached_tokens for o in group)
        completion += sum(len(o.token_ids) for o in group)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0 if hide_cached else cached},
        "completion_tokens_details": {
            "accepted_prediction_tokens": sum(o.accepted_draft_tokens for o in finals),
            "rejected_prediction_tokens": sum(o.draft_tokens - o.accepted_draft_tokens for o in finals)},
    }


def openai_finish(out: RequestOutput) -> str | None:
    return (out.finish_reason or "stop") if out.finished else None
