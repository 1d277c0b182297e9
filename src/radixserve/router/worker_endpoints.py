"""Worker endpoints that routers ask for and ``radixserve.server.app`` does not serve yet.

SGLang's router (``sglang-router`` 0.3.2, regular HTTP mode) calls, on each worker:
``GET /health`` (health checks), ``GET /server_info`` (then ``/get_server_info`` on 404),
``GET /model_info`` (then ``/get_model_info`` on 404, with a deprecation warning),
``GET /get_load`` (its ``/get_loads`` and the ``power_of_two`` policy), ``POST /flush_cache``,
and passes ``/generate``, ``/v1/completions``, ``/v1/chat/completions`` through. It also
probes each worker with an HTTP/2 preface (``PRI *``) to tell gRPC from HTTP workers;
uvicorn answers that with a 400/404, which is what an HTTP worker should say.

:func:`install_router_endpoints` adds the two that are missing (``/model_info`` and
``/get_load``) to an app built by ``create_app``; the server can adopt them as they are.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install_router_endpoints"]


def install_router_endpoints(app: Any) -> None:
    """Add ``GET /model_info`` and ``GET /get_load`` to a ``create_app`` FastAPI app."""
    bridge = app.state.bridge
    srv = app.state.server
    engine = srv.engine

    get_model_info = next((r.endpoint for r in app.routes if getattr(r, "path", None) == "/get_model_info"),
                          None)

    async def model_info() -> dict[str, Any]:
        info: dict[str, Any] = dict(await get_model_info()) if get_model_info is not None else {}
        arch = getattr(engine.model_config, "arch", None)
        info.setdefault("model_path", engine.config.model)
        info.setdefault("tokenizer_path", engine.config.model)
        info.setdefault("is_generation", True)
        hf = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(arch or "")
        info["architectures"] = [hf] if hf else None
        return info

    async def get_load() -> list[dict[str, Any]]:
        # SGLang's shape: one entry per data-parallel rank of this server.
        s = await bridge.stats()
        return [{
            "dp_rank": 0,
            "num_reqs": s["running_requests"] + s["waiting_requests"],
            "num_waiting_reqs": s["waiting_requests"],
            "num_tokens": s["kv_capacity_tokens"] - s["kv_free_tokens"] - s["evictable_tokens"],
        }]

    app.add_api_route("/model_info", model_info, methods=["GET"])
    app.add_api_route("/get_load", get_load, methods=["GET"])
