"""Makes a vLLM-CPU process on an AVX-512 host compute as it would on an AVX2-only CPU, for
proxy runs of ``side_by_side.py --cap-isa avx2`` beside ``RADIXSERVE_CPU_ISA=avx2``.

vLLM-CPU picks its kernel library (``_C``, ``_C_AVX512`` or ``_C_AVX2``) and some attention
paths from ``torch.cpu._is_avx512_supported()`` and friends, which read the silicon, not
``ATEN_CPU_CAPABILITY``; serve_vllm.sh puts this folder on ``PYTHONPATH`` (with ATen, oneDNN
and MKL capped by their own variables) so every process it spawns sees an AVX2 CPU. Only
active when ``PEER_CPU_ISA=avx2``.
"""

import os

if os.environ.get("PEER_CPU_ISA") == "avx2":
    import torch.cpu

    for _name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                  "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
