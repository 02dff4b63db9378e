#!/usr/bin/env bash
# GPU run (nvidia-h200-x2): the AgentX-style workload through the real Ray Serve app:
# P/D (1 prefill + 1 decode, KV over CUDA IPC) vs aggregated (2 independent decode ranks),
# session affinity against plain least-loaded routing for the aggregated layout (with one
# prefill and one decode replica there is no routing choice for affinity to make). The
# baseline is routing.policy least_loaded, not `session_affinity: false`: that one still binds
# requests by their prompt head (policy 'prefix'). Reports under $OUT/agentx/.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
[ -f checkpoints/bench/random_weights.json ] || t 120 python3 -m engine.checkpoint --preset bench --out checkpoints/bench \
  --dtype bfloat16 --device cuda > "$OUT/checkpoint.log" 2>&1
WORKLOAD="--trace-sessions 8 --turns 4 8 --system-tokens 3000 --task-tokens 1000 --answer-tokens 20 80
  --tool-tokens 200 1500 --large-tool-tokens 3000 8000 --large-tool-prob 0.2 --think-mean 1.0 --max-context 32000"
AGG='{prefill: {replicas: 0}, kv_transport: {backend: none}, decode: {dp_size: 2, expert_parallel: false}}'
run() {  # label, extra overrides...
  local label=$1; shift
  t ${AGENTX_STEP_S:-170} python3 -m bench.agentx run --config configs/agentx-h200x2.yaml "$@" --concurrency ${CONCURRENCY:-2 4 8} \
    --sessions 8 $WORKLOAD --gpus 2 --num-cpus 16 --quiet --label "$label" --out "$OUT/agentx/$label" \
    > "$OUT/agentx-$label.log" 2>&1
}
run pd-affinity
run agg-affinity --override "$AGG"
run agg-least-loaded --override "$AGG" --override '{routing: {policy: least_loaded}}'
python3 -m bench.agentx report "$OUT"/agentx/* > "$OUT/agentx-report.txt" 2>&1
cat "$OUT/steps.txt"; tail -30 "$OUT/agentx-report.txt"
