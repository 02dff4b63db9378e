#!/usr/bin/env bash
# GPU run (nvidia-h200-x2, about 4 minutes): next-turn TTFT after a prefix hit through the Serve
# app (aggregated layout, so the hit is on the rank that prefilled), bounded vs exact window
# replay, at 8K / 32K / 100K context. Rows and table under $OUT. REPLAY_WARMUP=0 on a fresh machine
# (empty Triton cache) measures what the first requests after the engine's own warm-up still pay.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
[ -f checkpoints/bench/random_weights.json ] || t 120 python3 -m engine.checkpoint --preset bench --out checkpoints/bench \
  --dtype bfloat16 --device cuda > "$OUT/checkpoint.log" 2>&1
AGG='{prefill: {replicas: 0}, kv_transport: {backend: none}, decode: {dp_size: 2, expert_parallel: false}}'
t ${REPLAY_STEP_S:-300} python3 -m bench.serve_replay_ttft --config configs/agentx-h200x2.yaml --override "$AGG" \
  --contexts ${REPLAY_CONTEXTS:-8192 32768 100000} --modes bounded exact --warmup ${REPLAY_WARMUP:-1} --num-cpus 16 \
  --json "$OUT/serve_replay.jsonl" \
  > "$OUT/serve_replay.log" 2>&1
cat "$OUT/steps.txt"; tail -8 "$OUT/serve_replay.log"
