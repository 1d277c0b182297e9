#!/usr/bin/env bash
# Online benchmark of one already-running OpenAI-compatible server on the four peer workloads,
# one workload at a time, logging `uptime` before each run.
#   benchmarks/peers/run_bench.sh ENGINE_TAG URL SERVED_MODEL [extra radixserve-bench args]
# Results: $RESULTS/ENGINE_TAG/WORKLOAD/{results.md,results.json}, log: $RESULTS/ENGINE_TAG/log.txt
set -u
TAG=$1; URL=$2; MODEL=$3; shift 3
RESULTS=${RESULTS:-${PEERS_DIR:-/opt/peers}/results}
RATE=${RATE:-4}
WORKLOADS=${WORKLOADS:-few-shot multi-turn-short tree-of-thought gsp}
# sizes (same for every engine): 32 few-shot questions, 16 three-turn chats, a depth-4 binary
# thought tree (2+4+8+16 requests), gsp defaults (4 groups x 8 prompts, 512-token system prompt)
PARAMS=${PARAMS:---param few-shot.num_questions=32 --param multi-turn-short.num_conversations=16 --param tree-of-thought.depth=4}
mkdir -p "$RESULTS/$TAG"
LOG="$RESULTS/$TAG/log.txt"
# warm-up request (first-request compilation / allocation stays out of the numbers)
curl -s -m 120 "$URL/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\":\"$MODEL\",\"prompt\":\"Hello, my name is\",\"max_tokens\":8,\"temperature\":0}" >/dev/null
for W in $WORKLOADS; do
  # Start every run cold. radixserve bench itself POSTs /flush_cache (radixserve, SGLang);
  # vLLM needs /reset_prefix_cache (only with VLLM_SERVER_DEV_MODE=1), llama-server an erase
  # of each slot. Best effort: 404s elsewhere are fine.
  curl -s -o /dev/null -X POST "$URL/reset_prefix_cache"
  for s in 0 1 2 3; do curl -s -o /dev/null -X POST "$URL/slots/$s?action=erase"; done
  echo "== $TAG $W $(date -u +%FT%TZ) uptime: $(uptime)" | tee -a "$LOG"
  CMD=(radixserve bench --url "$URL" --served-model "$MODEL" --workloads "$W"
       --request-rate "$RATE" --seed 0 --timeout 300 --no-plots --no-progress
       --output-dir "$RESULTS/$TAG/$W" $PARAMS "$@")
  echo "\$ ${CMD[*]}" | tee -a "$LOG"
  start=$(date +%s)
  "${CMD[@]}" 2>&1 | tee -a "$LOG"
  echo "-- $W took $(( $(date +%s) - start )) s" | tee -a "$LOG"
done
