"""Running an ASGI app under uvicorn for a command (``serve``, ``router``): one server class
that prints one line once it listens, with the bound port (the real one for ``--port 0``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

__all__ = ["AnnouncingServer"]


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that prints ``announce(port)`` once its socket is bound and, when
    ``ready`` is given, once ``ready()`` answered True (e.g. the engine core loaded the model)."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[int], str],
                 ready: Callable[[], Awaitable[bool]] | None = None):
        super().__init__(config)
        self.announce = announce
        self.ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        ok = await self.ready() if self.ready is not None else True
        if self.started and not self.should_exit and ok:
            print(self.announce(self.bound_port()), flush=True)

    def bound_port(self) -> int:
        for srv in getattr(self, "servers", []):
            for sock in getattr(srv, "sockets", []) or []:
                return sock.getsockname()[1]
        return self.config.port
