"""HTTP serving: the FastAPI app (OpenAI + SGLang-native API) and the engine-thread bridge.

``create_app(engine)`` is all a caller needs; ``radixserve serve`` wraps it in uvicorn.
"""

from __future__ import annotations

from radixserve.server.app import create_app
from radixserve.server.bridge import EngineBridge, EngineError, RequestStream

__all__ = ["EngineBridge", "EngineError", "RequestStream", "create_app"]
