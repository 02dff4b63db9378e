#!/usr/bin/env bash
# A long prompt's prefill with nothing cached: TTFT at 8K-100K and a profile of a 32K prefill
# split into the layer's parts (bench/prefill_long.py); then the decode targets' forward rows
# (batch 1 from 8K to 512K with FP8 index keys; batch 64 at 8K against the roofline, MoE share).
# Carry .devpack/pydantic-site.tgz. PREFILL_ARGS adds flags to the prefill runs.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
STEPS=${STEPS:-"prefill b1 b64"}
on() { [[ " $STEPS " == *" $1 "* ]]; }
on prefill && t 220 python3 -m bench.prefill_long --contexts 32768 8192 100000 --chunks 1024 --repeats 2 \
  --profile "$OUT/prefill_profile.md" --json "$OUT/prefill.jsonl" $PREFILL_ARGS > "$OUT/prefill.log" 2>&1
on b1 && t 100 python3 -m bench.forward --batch 1 --contexts 8192 131072 524288 --index-dtype fp8_e4m3 --iters 10 \
  --json "$OUT/forward.jsonl" > "$OUT/forward_b1.log" 2>&1
on b64 && t 100 python3 -m bench.forward --batch 64 --contexts 8192 --moe-share --iters 10 \
  --json "$OUT/forward.jsonl" > "$OUT/forward_b64.log" 2>&1
tail -n 8 "$OUT/prefill.log"; head -n 40 "$OUT/prefill_profile.md"
grep -a "^|" "$OUT"/forward_b*.log
cat "$OUT/steps.txt"
