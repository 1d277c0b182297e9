"""``radixserve router --worker URL [--worker URL ...] [--worker-events tcp://...]``.

Wiring into the main CLI (``radixserve/cli.py``)::

    from radixserve.router.cli import add_router_arguments, run_router
    r = sub.add_parser("router", help="route requests over several workers (data parallel)")
    add_router_arguments(r)
    ...
    if args.command == "router":
        return run_router(args)

``python -m radixserve.router ...`` runs the same thing on its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Optional, Sequence

from radixserve.placement.config import FIELD_HELP, POLICIES, RouterConfig

__all__ = ["add_router_arguments", "config_from_args", "run_router", "main", "build_parser"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", dest="workers", action="append", default=[], metavar="URL",
                        help=FIELD_HELP["workers"] + " (repeat for each worker)")
    parser.add_argument("--worker-events", dest="worker_events", action="append", default=[],
                        metavar="ENDPOINT", help=FIELD_HELP["worker_events"])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    parser.add_argument("--log-level", default="info", choices=_LOG_LEVELS,
                        help="log level (default: info)")
    group = parser.add_argument_group("routing options")
    for name in RouterConfig.field_names():
        if name in ("workers", "worker_events"):
            continue
        default = _DEFAULTS[name]
        kw: dict[str, Any] = {"dest": name, "default": None,
                              "help": f"{FIELD_HELP.get(name, name)} (default: {default})"}
        if isinstance(default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, int):
            kw["type"], kw["metavar"] = int, "N"
        elif isinstance(default, float):
            kw["type"], kw["metavar"] = float, "X"
        elif isinstance(default, tuple):  # repeated flag (api_key)
            kw["action"], kw["metavar"] = "append", name.upper()
        if name == "policy":
            kw["choices"] = list(POLICIES)
        group.add_argument("--" + name.replace("_", "-"), **kw)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed arguments; ValueError names the bad option."""
    kw = {n: getattr(args, n) for n in RouterConfig.field_names()
          if getattr(args, n, None) is not None}
    return RouterConfig(**kw)


def serve(app: Any, host: str, port: int, log_level: str) -> None:
    """Run the router's ASGI app under uvicorn (httptools parser, uvloop) until SIGINT/SIGTERM."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                bound = port
                for srv in getattr(self, "servers", []):
                    for sock in getattr(srv, "sockets", []) or []:
                        bound = sock.getsockname()[1]
                        break
                print(f"radixserve router: listening on http://{host}:{bound}", flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5)
    server = _Server(config)
    server.run()
    if not server.started:
        raise RuntimeError("the router did not start (see the log above)")


def run_router(args: argparse.Namespace) -> int:
    from radixserve.router.app import RouterApp
    from radixserve.router.fleet import Router

    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"radixserve router: error: {e}", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"radixserve router: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(RouterApp(Router(cfg)), args.host, args.port, args.log_level)
    except RuntimeError as e:  # the router could not start (no worker answered, ...)
        print(f"radixserve router: error: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixserve router",
        description="Route OpenAI and SGLang-native requests over several radixserve workers, "
                    "by what each worker's cache holds (its own cache events) and its load.")
    add_router_arguments(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_router(args)
    except KeyboardInterrupt:
        return 130
