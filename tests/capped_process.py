"""Run as a script under ``RADIXSERVE_CPU_ISA=<level>``: reports what the process cap did
(the kernels' build flags and paths, torch's libraries' levels) as one JSON line, and saves
the tiny model's logits on our kernels, for the weights in the file named by argv[1], to the
file named by argv[2] (float32 and bfloat16; the weights come from the caller because torch's
random normals are drawn by per-CPU-level code), for ``test_cpu_paths.test_a_capped_process_builds_and_computes_as_a_cpu_of_its_level``."""

from __future__ import annotations

import json
import os
import sys

import radixserve  # noqa: F401  (caps torch's libraries before torch's first op)
import torch

from radixserve.kernels.isa import LIBRARY_CAPS, host_isa
from radixserve.engine.runner import ModelRunner
from radixserve.kernels import builder
from radixserve.kernels import library as kernels
from radixserve.model.arch.forward_batch import ForwardBatch
from radixserve.model.testing.tiny import tiny_random_config

FLOAT32_MODE_IMPL = {"generic": kernels.IMPL_GENERIC, "avx2": kernels.IMPL_AVX2, "avx512": kernels.IMPL_F32}


def tiny_logits(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, isa: str) -> torch.Tensor:
    """The tiny model's logits over two sequences, on our kernels at level ``isa`` (the
    float32-mode attention of that level)."""
    cfg = tiny_random_config()
    sd = {k: v.to(dtype) for k, v in state_dict.items()}
    runner = ModelRunner.from_config(cfg, sd, kv_capacity=256, dtype=dtype, cpu_isa=isa,
                                     linear_backend="radixserve")
    runner.attn_backend.attention_impl = FLOAT32_MODE_IMPL[isa]
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    batch = ForwardBatch.build([ids[:40], ids[40:]], [0, 0], [torch.arange(40), torch.arange(40, 70)],
                               return_all_logits=[True, True])
    return torch.cat(runner.forward(batch).all_logits)


def main() -> None:
    torch.set_num_threads(1)
    k = kernels.load_kernels()
    level = host_isa()
    weights = torch.load(sys.argv[1])
    logits = {str(dt): tiny_logits(weights, dt, level) for dt in (torch.float32, torch.bfloat16)}
    torch.save(logits, sys.argv[2])
    print(json.dumps({
        "host_isa": level,
        "cflags": list(builder.kernel_cflags()),
        "available_isas": list(k.available_isas()),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "library_env": {name: os.environ.get(name) for name in LIBRARY_CAPS["avx2"]},
    }))


if __name__ == "__main__":
    main()
