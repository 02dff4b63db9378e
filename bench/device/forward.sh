#!/usr/bin/env bash
# GPU run 2: the engine on the `bench` model: decode step vs context and vs the roofline
# (bf16 and FP8 KV), MoE share, CUDA graphs vs eager, Triton vs torch MoE GEMM, the Gluon MLA
# kernel on and off, transformers generate, next-turn TTFT with bounded replay, and (2 GPUs) the
# same-host KV transport.
# STEPS picks a subset, e.g. STEPS="fp8 b64 replay ipc"; "tune" first measures this GPU's launch
# configs (wideep_kernels/tuned/<gpu>.json, about 4-5 minutes), which the later steps then use.
source bench/device/setup.sh
STEPS=${STEPS:-"tune b1 b64 bf16 fp8 hf"}
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
on() { [[ " $STEPS " == *" $1 "* ]]; }
# PROFILE=1: also write each eager step's kernel table (count, device time) to $OUT/profile.txt
PROF=${PROFILE:+--profile $OUT/profile.txt}
if on tune; then
  t 330 python3 -m bench.tune_kernels --json "$OUT/tune.json" > "$OUT/tune.log" 2>&1
  cp wideep_kernels/tuned/*.json "$OUT/" 2>/dev/null
fi
on b1 && t 90 python3 -m bench.forward --batch 1 --contexts 8192 --iters 10 --unfused-gate --unfused-small --mla-gluon --shared-fusion --overlap $PROF --json "$OUT/forward.jsonl" \
  > "$OUT/forward_b1.log" 2>&1
on b64 && t 100 python3 -m bench.forward --batch 64 --contexts 8192 --moe-share --graphs-vs-eager --unfused-gate --unfused-small --mla-gluon --shared-fusion --overlap \
  --moe-gemm triton grouped_mm \
  --iters 10 $PROF --json "$OUT/forward.jsonl" > "$OUT/forward_b64.log" 2>&1
for kv in bf16 fp8; do
  on $kv && t 150 python3 -m bench.forward --batch 16 --contexts 8192 65536 131072 524288 \
    --kv-dtype "$([ $kv = fp8 ] && echo fp8_e4m3 || echo auto)" --iters 10 --json "$OUT/forward.jsonl" $([ $kv = bf16 ] && echo $PROF) > "$OUT/forward_b16_$kv.log" 2>&1
done
on hf && t 120 python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --batches 1 16 64 \
  --out "$OUT/engine_vs_hf.jsonl" > "$OUT/engine_vs_hf.log" 2>&1
on replay && t 150 python3 -m bench.replay_ttft --contexts ${REPLAY_CONTEXTS:-8192 32768 100000} --repeats 2 --json "$OUT/replay.jsonl" \
  > "$OUT/replay.log" 2>&1
if on ipc && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  t 60 python3 -m bench.kv_ipc_bench --out "$OUT/kv_ipc.json" > "$OUT/kv_ipc.log" 2>&1
fi
cat "$OUT/steps.txt"
