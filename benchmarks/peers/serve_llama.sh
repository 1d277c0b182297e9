#!/usr/bin/env bash
# llama.cpp llama-server (built from llama-cpp-python 0.3.36's vendor/llama.cpp) on the same GGUF
# radixserve loads. Defaults of this build worth knowing: cache_prompt=true per request (a slot
# keeps its last prompt's KV and reuses the common prefix), --slot-prompt-similarity 0.1 (a
# request goes to the idle slot whose cached prompt matches it best), --cache-ram 8192 MiB
# (slot states are saved to host RAM and restored for matching prompts).
GGUF=$(python -c "from radixserve.model.registry import smollm2_gguf_path; print(smollm2_gguf_path())")
exec ${LLAMA_SERVER:-/tmp/peers/llama-build/bin/llama-server} -m "$GGUF" --host 127.0.0.1 \
    --port ${PORT:-8080} -c 8192 --parallel 4 --cont-batching -t 2 "$@"
