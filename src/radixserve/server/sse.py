"""Server-sent events, ended the same way by every streaming endpoint."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from radixserve.engine.async_client import RequestStream
from radixserve.engine.client import EngineDeadError
from radixserve.server.errors import APIError, error_chunk


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(body: AsyncIterator[str], srv: Any, streams: Sequence[RequestStream]) -> StreamingResponse:
    """Stream SSE chunks. An error mid-stream (the status line is already sent) becomes an
    OpenAI-shaped error chunk; every stream ends with ``data: [DONE]``; requests still running
    when the stream stops (client gone, error) are aborted so their slots and locks are freed."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in body:
                yield chunk
        except APIError as e:
            yield error_chunk(e.message, e.type, e.status)
        except EngineDeadError as e:
            yield error_chunk(f"the engine is not available: {e}", "service_unavailable", 503)
        finally:
            srv.abort_unfinished(streams)
        yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream")
