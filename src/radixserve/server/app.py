"""The HTTP server (API process): assembly of the app and its lifecycle.

``create_app(engine_or_config, server_config)`` builds a FastAPI app whose lifespan starts
an engine core — its own process for an :class:`EngineConfig` (what ``radixserve serve``
does), or a thread over an existing :class:`Engine` (tests, notebooks) — and a client for
it. The app answers ``/health`` with 503 until the core is ready and whenever it is gone;
requests meanwhile get 503 with ``Retry-After``, never a hang.

Routes live in ``openai_routes``, ``native_routes``, ``ops_routes`` and ``session_routes``;
errors in ``errors``; keys and tenants in ``auth``; limits in ``limits``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from radixserve.config import EngineConfig, ServerConfig
from radixserve.engine.async_client import AsyncEngineClient
from radixserve.engine.client import EngineDeadError
from radixserve.engine.launch import start_core_process, start_core_thread
from radixserve.server import session_routes
from radixserve.server.auth import AuthMiddleware, KeyRing
from radixserve.server.errors import InternalErrorMiddleware, install_error_handlers
from radixserve.server.limits import BodyLimitMiddleware
from radixserve.server.metrics import ServerMetrics
from radixserve.server.native_routes import NativeRoutes
from radixserve.server.openai_routes import OpenAIRoutes
from radixserve.server.openapi import install_openapi
from radixserve.server.ops_routes import VERSION, OpsRoutes
from radixserve.server.context import ServerContext

logger = logging.getLogger("radixserve.server")


def create_app(engine: Any, config: ServerConfig | None = None, **server_options: Any) -> FastAPI:
    """Build the app. ``engine`` is an :class:`EngineConfig` (a core process is started) or
    an in-process ``Engine`` (its core runs on a thread; do not step it elsewhere meanwhile).
    ``server_options`` are :class:`ServerConfig` fields, when no ``config`` is given."""
    if config is None:
        config = ServerConfig(**server_options)
    elif server_options:
        raise ValueError("pass either config= or server options, not both")
    keyring = KeyRing(config.api_key, config.api_key_file, config.admin_key)
    if isinstance(engine, EngineConfig):
        from radixserve.model.registry import load_tokenizer

        engine_config = engine
        tokenizer = load_tokenizer(engine.model)
        if config.dp > 1:
            return _create(engine_config, config, keyring, tokenizer, *_dp_cores(engine_config, config))
        if config.core_in_process:
            start = lambda: start_core_thread(engine_config)  # noqa: E731
        else:
            start = lambda: start_core_process(engine_config, config.log_level)  # noqa: E731
    else:
        if config.dp > 1:
            raise ValueError("dp > 1 needs an EngineConfig (one engine-core process per rank)")
        engine_config = engine.config
        tokenizer = engine.tokenizer
        core = engine.core
        start = lambda: start_core_thread(core)  # noqa: E731
    return _create(engine_config, config, keyring, tokenizer, AsyncEngineClient(tokenizer), lambda: [start()])


def _dp_cores(engine_config: EngineConfig, config: ServerConfig) -> tuple[Any, Callable[[], list]]:
    """N engine-core configs (threads split between them, each publishing its cache events
    on a private socket) and the client that routes between them."""
    n = config.dp
    threads = engine_config.num_threads or (os.cpu_count() or 1)
    tmp = tempfile.mkdtemp(prefix="radixserve-dp-")
    os.chmod(tmp, 0o700)
    events = [f"ipc://{tmp}/events-{i}" for i in range(n)]
    cfgs = [engine_config.replace(num_threads=max(1, threads // n), kv_events_endpoint=events[i],
                                  seed=engine_config.seed + i) for i in range(n)]
    from radixserve.model.registry import load_tokenizer
    from radixserve.server.dp_client import DPEngineClient

    client = DPEngineClient(load_tokenizer(engine_config.model), events, config.dp_policy, tmp)
    return client, lambda: [start_core_process(c, config.log_level) for c in cfgs]


def _create(engine_config: EngineConfig, config: ServerConfig, keyring: KeyRing, tokenizer: Any,
            client: Any, start: Callable[[], list]) -> FastAPI:
    handles: list = []
    name = config.served_model_name or engine_config.model
    srv = ServerContext(config, client, tokenizer, name, engine_config.model, keyring, ServerMetrics())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        handles[:] = start()
        app.state.core = handles[0]
        app.state.cores = handles

        async def connect() -> None:
            try:
                await client.start(handles if len(handles) > 1 else handles[0], config.startup_timeout_s)
                logger.info("engine core%s ready (%s, pid %s)", "s" if len(handles) > 1 else "",
                            handles[0].kind, ", ".join(str(h.pid) for h in handles))
            except EngineDeadError as e:
                logger.error("%s", e)
                for hook in app.state.on_start_failure:
                    hook()

        starter = asyncio.create_task(connect())
        app.state.ready = starter
        try:
            yield
        finally:
            starter.cancel()
            await client.close()
            srv.close()

    app = FastAPI(title="radixserve", version=VERSION, lifespan=lifespan)
    app.state.server = srv
    app.state.client = client
    app.state.on_start_failure = []  # e.g. the CLI stops uvicorn: nothing to serve
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, keyring=keyring)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.body_read_timeout_s)
    app.add_middleware(InternalErrorMiddleware)  # last added: outermost
    OpenAIRoutes(srv).register(app)
    NativeRoutes(srv).register(app)
    OpsRoutes(srv, engine_config).register(app)
    session_routes.register(app, srv)
    install_openapi(app)
    return app


__all__ = ["create_app"]
