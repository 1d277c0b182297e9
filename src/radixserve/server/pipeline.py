"""The steps every generation route shares, whatever the API: the choices a request
submits (:class:`Choices`), its outputs as they come (:func:`merge`), and the two ways of
answering — a stream of SSE chunks or one body — both written by a :class:`Renderer`.

A route parses and validates its body (``protocol/``), tokenizes, fills a ``Choices``,
submits it (``ServerContext.submit``) and hands a renderer to ``ServerContext.respond``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.request import RequestOutput
from radixserve.engine.async_client import RequestStream
from radixserve.images import ImageInput
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError

__all__ = ["Choices", "Renderer", "merge", "raise_if_failed"]


@dataclass
class Choices:
    """What one request submits, one entry per choice (prompts x n), in response order."""

    items: list[tuple[list[int], SamplingParams]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # for the request log
    images: list[Sequence[ImageInput]] = field(default_factory=list)
    client_rids: list[str | None] = field(default_factory=list)  # names in the tenant's namespace
    session_ids: list[str | None] = field(default_factory=list)  # the client's session names

    def add(self, ids: list[int], params: SamplingParams, label: str, images: Sequence[ImageInput] = (),
            rid: str | None = None, session_id: str | None = None) -> None:
        self.items.append((ids, params))
        self.labels.append(label)
        self.images.append(images)
        self.client_rids.append(rid)
        self.session_ids.append(session_id)


class Renderer(Protocol):
    """A response format: SSE chunks as outputs come, or one body from the final outputs."""

    def stream(self) -> AsyncIterator[str]: ...

    def final(self, finals: list[RequestOutput]) -> Any: ...


def raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        # A request the engine could not run (e.g. prompt + max_tokens larger than the KV
        # pool, or its sampling produced no valid distribution): a property of the request.
        raise APIError(400, out.error or "the request failed", code="request_failed")


async def merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending: dict[asyncio.Future, int] = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
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
