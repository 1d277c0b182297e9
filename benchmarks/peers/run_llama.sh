#!/usr/bin/env bash
# llama-server cannot be flushed (slot erase does not clear its --cache-ram host prompt cache),
# so start a fresh server for each workload run.
#   RATE=4 benchmarks/peers/run_llama.sh TAG
set -u
TAG=$1; PORT=${PORT:-8080}; HERE=$(dirname "$0")
for W in ${WORKLOADS:-few-shot multi-turn-short tree-of-thought gsp}; do
  PORT=$PORT "$HERE/serve_llama.sh" > "${PEERS_DIR:-/opt/peers}/llama-serve-$TAG-$W.log" 2>&1 &
  PID=$!
  for i in $(seq 1 60); do curl -sf -m 2 "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  WORKLOADS=$W "$HERE/run_bench.sh" "$TAG" "http://127.0.0.1:$PORT" smollm2
  kill "$PID"; wait "$PID" 2>/dev/null
done
