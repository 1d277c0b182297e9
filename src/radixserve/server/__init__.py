"""HTTP serving (the API process): OpenAI + SGLang-native API in front of an engine core.

``create_app(EngineConfig(...) | Engine, ServerConfig(...))`` is all a caller needs;
``radixserve serve`` wraps it in uvicorn.
"""

from __future__ import annotations

from radixserve.server.app import create_app

__all__ = ["create_app"]
