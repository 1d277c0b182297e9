"""Server-sent events, ended the same way by every streaming endpoint."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from radixserve.engine.async_client import RequestStream
from radixserve.engine.client import EngineDeadError
from radixserve.server.errors import APIError, error_chunk

logger = logging.getLogger("radixserve.server")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(body: AsyncGenerator[str, None], srv: Any, streams: Sequence[RequestStream]) -> StreamingResponse:
    """Stream SSE chunks. An error mid-stream (the status line is already sent) becomes an
    OpenAI-shaped error chunk — a bug too, as a 500 — so the stream still ends properly, with
    ``data: [DONE]``, and the connection stays usable; requests still running when the stream
    stops (client gone, error) are aborted so their slots and locks are freed. Chunks are
    encoded here, inside the guard: text that cannot be encoded is an error like any other,
    not a stream cut in the middle."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk.encode("utf-8")
        except APIError as e:
            yield error_chunk(e.message, e.type, e.status).encode()
        except EngineDeadError as e:
            yield error_chunk(f"the engine is not available: {e}", "service_unavailable", 503).encode()
        except Exception as e:
            logger.exception("stream failed")
            yield error_chunk(f"internal error: {type(e).__name__}", "server_error", 500).encode()
        finally:
            srv.abort_unfinished(streams)
            await body.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream")
