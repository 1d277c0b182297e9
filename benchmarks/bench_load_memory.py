"""Resident memory of an engine core after it loaded a model, against the file's size (not a test).

    python benchmarks/bench_load_memory.py --model /work/bench-models/bench-llama-1b-q4_0.gguf
    RADIXSERVE_CPU_ISA=avx2 python benchmarks/bench_load_memory.py --model /work/bench-models/bench-llama-1b-q4_0.gguf

Prints, for the engine-core process alone (the served tree adds the API process): resident
memory before anything of radixserve is imported, after ``import torch`` (the floor every
process of the engine pays), after the core loaded the model (``rss_after_load``, what
``/server_info`` reports), and the peak during the load; each also as a multiple of the file.
"""

from __future__ import annotations

import argparse
import os
import sys


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a GGUF file (or a model name: no file size then)")
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--kv-cache-tokens", type=int, default=4096)
    args = ap.parse_args(argv)
    start = status_mib("VmRSS")
    import torch  # noqa: F401  (the floor: its runtime is resident in every engine process)

    after_torch = status_mib("VmRSS")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    from radixserve.config import EngineConfig
    from radixserve.engine.core import EngineCore
    from radixserve.kernels.isa import describe

    core = EngineCore(EngineConfig(model=args.model, weight_dtype=args.weight_dtype,
                                   kv_cache_tokens=args.kv_cache_tokens))
    loaded = core.rss_after_load / 2**20
    peak = status_mib("VmHWM")
    size = os.path.getsize(args.model) / 2**20 if os.path.isfile(args.model) else 0.0
    core.close()

    def of_file(mib: float) -> str:
        return f"{mib:8.0f} MiB" + (f"  ({mib / size:.2f}x the file)" if size else "")

    print(f"{args.model}: {size:.0f} MiB; weights {core.weight_choice.format} ({core.weight_choice.reason})")
    print(f"  cpu: {describe()}")
    print(f"  interpreter       {of_file(start)}")
    print(f"  + import torch    {of_file(after_torch)}")
    print(f"  after load        {of_file(loaded)}")
    print(f"  peak during load  {of_file(peak)}")


if __name__ == "__main__":
    main()
