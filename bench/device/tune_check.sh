#!/usr/bin/env bash
# Launch tables on this GPU: `tune` runs bench.tune_kernels (its table is copied to $OUT); `ab` times
# the decode forward (batch 1 at 8K and 512K with FP8 index keys, batch 64 at 8K) and a 32K prompt's
# prefill under each of TABLES in turn, via WIDEEP_TUNED_TABLE (`own`: this GPU's table, or the same
# capability's). Carry .devpack/pydantic-site.tgz. TUNE_ARGS adds flags to the tuner.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
STEPS=${STEPS:-"tune"}
TABLES=${TABLES:-"none NVIDIA_H200 own"}
on() { [[ " $STEPS " == *" $1 "* ]]; }
if on tests; then
  t 200 python3 -m pytest -q -x -k "cuda or gpu" tests/test_kernel_mla_decode.py > "$OUT/tests.log" 2>&1
  tail -n 3 "$OUT/tests.log"
fi
if on tune; then
  t ${TUNE_LIMIT:-540} python3 -m bench.tune_kernels --json "$OUT/tune.json" $TUNE_ARGS > "$OUT/tune.log" 2>&1
  cp wideep_kernels/tuned/*.json "$OUT/" 2>/dev/null
  grep -a "^|" "$OUT/tune.log" || tail -n 5 "$OUT/tune.log"
fi
if on ab; then
  for table in $TABLES; do
    env_table=$table; [ "$table" = own ] && env_table=
    export WIDEEP_TUNED_TABLE=$env_table
    t 100 python3 -m bench.forward --batch 1 --contexts 8192 524288 --index-dtype fp8_e4m3 --iters 10 \
      --json "$OUT/forward_$table.jsonl" > "$OUT/forward_b1_$table.log" 2>&1
    t 100 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 \
      --json "$OUT/forward_$table.jsonl" > "$OUT/forward_b64_$table.log" 2>&1
    t 120 python3 -m bench.prefill_long --contexts 32768 --chunks 1024 --repeats 2 \
      --json "$OUT/prefill_$table.jsonl" > "$OUT/prefill_$table.log" 2>&1
    echo "== $table"; grep -a "^|" "$OUT"/forward_b*_$table.log; tail -n 3 "$OUT/prefill_$table.log"
  done
fi
cat "$OUT/steps.txt"
