"""Shared command line for the examples: the embedded model by default, ``--url`` for a server.

    python examples/few_shot_qa.py                          # Engine("smollm2-135m") in-process
    python examples/few_shot_qa.py --url http://127.0.0.1:30000
    python examples/few_shot_qa.py --model tiny-random      # quick smoke run (gibberish)

``RADIXSERVE_EXAMPLE_MODEL`` changes the default of ``--model`` (the tests run every
example on ``tiny-random`` that way).
"""

from __future__ import annotations

import argparse
import os

from radixserve.lang import Backend, EngineBackend, RuntimeEndpoint, set_default_backend


def setup(description: str) -> argparse.Namespace:
    """Parse the common flags and install the default backend."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--url", help="a running radixserve server (native API); default: embedded engine")
    ap.add_argument("--model", default=os.environ.get("RADIXSERVE_EXAMPLE_MODEL", "smollm2-135m"),
                    help="model for the embedded engine (default: $RADIXSERVE_EXAMPLE_MODEL or smollm2-135m)")
    ap.add_argument("--kv-cache-tokens", type=int, default=8192)
    args = ap.parse_args()
    backend: Backend
    if args.url:
        backend = RuntimeEndpoint(args.url)
    else:
        from radixserve.engine.engine import Engine

        backend = EngineBackend(Engine(args.model, kv_cache_tokens=args.kv_cache_tokens))
    set_default_backend(backend)
    return args
