#!/usr/bin/env bash
# llama.cpp llama-server (built by benchmarks/peers/build_llama.sh from llama-cpp-python 0.3.36's
# vendor/llama.cpp) on the same GGUF radixserve loads: SmolLM2-135M-Instruct Q4_1, so every
# decoded token reads 4-bit weights (radixserve and vLLM read bf16 or f32 ones).
# Defaults of this build worth knowing: cache_prompt=true per request (a slot keeps its last
# prompt's KV and reuses the common prefix), --slot-prompt-similarity 0.1 (a request goes to
# the idle slot whose cached prompt matches it best), --cache-ram 8192 MiB (slot states are
# saved to host RAM and restored for matching prompts; slot erase does not clear it, so start a
# fresh server for each cold run).
#   LLAMA_CTX (default 8192): KV tokens in all (-c); LLAMA_PARALLEL (default 4): slots. Without
#   --kv-unified each slot gets LLAMA_CTX / LLAMA_PARALLEL tokens. Extra arguments go to llama-server.
GGUF=$(python -c "from radixserve.model.registry import smollm2_gguf_path; print(smollm2_gguf_path())")
exec ${LLAMA_SERVER:-/tmp/peers/llama-build/bin/llama-server} -m "$GGUF" --host 127.0.0.1 \
    --port ${PORT:-8080} -c ${LLAMA_CTX:-8192} --parallel ${LLAMA_PARALLEL:-4} --cont-batching -t 2 "$@"
