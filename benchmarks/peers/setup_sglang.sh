#!/usr/bin/env bash
# A venv in which SGLang's RadixCache imports on a CPU-only machine, for
# `benchmarks/bench_cache.py --sglang` (see benchmarks/README.md, "Radix tree micro-benchmark").
#   bash benchmarks/peers/setup_sglang.sh [VENV=/tmp/sglvenv] [SGL=/tmp/sgl]
# then: PYTHONPATH=$SGL/full taskset -c 0 $VENV/bin/python -W ignore benchmarks/bench_cache.py --sglang
# torch comes from the system site-packages and is never replaced.
set -euo pipefail
VENV=${1:-/tmp/sglvenv}
SGL=${2:-/tmp/sgl}
python -m venv --system-site-packages "$VENV"
"$VENV/bin/pip" download -q sglang==0.5.23 --no-deps -d "$SGL"
rm -rf "$SGL/full" && unzip -q "$SGL"/sglang-0.5.23-*.whl -d "$SGL/full"
# What `from sglang.srt.mem_cache.radix_cache import RadixCache` imports, without their deps.
"$VENV/bin/pip" install -q --no-deps pybase64 triton aiohttp multidict yarl propcache aiohappyeyeballs \
    aiosignal frozenlist dill apache-tvm-ffi==0.1.11 sentencepiece compressed-tensors loguru psutil
# sglang's configs import torchvision.transforms; PyPI has CUDA torchvision wheels only. The
# pure-Python part is enough: drop the CUDA-linked .so files and make the two fake-op
# registrations that need them conditional (the radix cache never touches torchvision).
"$VENV/bin/pip" download -q --no-deps torchvision==0.28.0 -d "$SGL/tv"
"$VENV/bin/pip" install -q --no-deps "$SGL"/tv/torchvision-0.28.0-*.whl
SP=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# torch installed in the virtual environment that runs this script rather than in the system
# site-packages: let the new venv see that environment's packages too (after its own).
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$SP/zz_parent_site.pth"
fi
rm -f "$SP"/torchvision/*.so
sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::q?nms")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))/' \
    "$SP/torchvision/_meta_registrations.py"
PYTHONPATH="$SGL/full" "$VENV/bin/python" -W ignore -c \
    "from sglang.srt.mem_cache.radix_cache import RadixCache; import sglang; print('sglang', sglang.__version__, 'ok')"
