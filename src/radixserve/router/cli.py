"""``radixserve router --worker URL [--worker URL ...] [--worker-events tcp://...]``: a
subcommand of ``radixserve`` (``cli.py``), or ``python -m radixserve.router`` on its own.
The routing options are generated from :class:`RouterConfig` (:mod:`radixserve.flags`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Optional, Sequence

from radixserve.config_rules import DEFAULT_HOST, DEFAULT_LOG_LEVEL, DEFAULT_PORT, LOG_LEVELS, check_int
from radixserve.flags import add_config_flags, given_options
from radixserve.placement.config import FIELD_HELP, POLICIES, RouterConfig

__all__ = ["add_router_arguments", "config_from_args", "run_router", "main", "build_parser"]


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", dest="workers", action="append", default=[], metavar="URL",
                        help=FIELD_HELP["workers"] + " (repeat for each worker)")
    parser.add_argument("--worker-events", dest="worker_events", action="append", default=[],
                        metavar="ENDPOINT", help=FIELD_HELP["worker_events"])
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default: {DEFAULT_PORT})")
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS,
                        help=f"log level (default: {DEFAULT_LOG_LEVEL})")
    add_config_flags(parser, RouterConfig, "routing options", FIELD_HELP, {"policy": POLICIES},
                     skip=("workers", "worker_events"))


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed arguments; ValueError names the bad option."""
    return RouterConfig(**given_options(RouterConfig, args))


def serve(app: Any, host: str, port: int, log_level: str) -> None:
    """Run the router's ASGI app under uvicorn (httptools parser, uvloop) until SIGINT/SIGTERM."""
    import uvicorn

    from radixserve.http_serve import AnnouncingServer

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5)
    server = AnnouncingServer(config, lambda bound: f"radixserve router: listening on http://{host}:{bound}")
    server.run()
    if not server.started:
        raise RuntimeError("the router did not start (see the log above)")


def run_router(args: argparse.Namespace) -> int:
    from radixserve.router.app import RouterApp
    from radixserve.router.fleet import Router

    try:
        cfg = config_from_args(args)
        check_int(args, "port", 0, 65535)  # as ServerConfig checks it
    except ValueError as e:
        print(f"radixserve router: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
