source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 32 --batches 128 --prompt-len 64"
for r in 1 2; do
  echo "== old $r" >> "$OUT/e2e.log"; t 120 bash -c "cd ab_old && PYTHONPATH=/tmp/site:\$PWD $H" >> "$OUT/e2e.log" 2>&1
  echo "== new $r" >> "$OUT/e2e.log"; t 120 $H >> "$OUT/e2e.log" 2>&1
done
t 120 python3 -m bench.forward --batch 128 --contexts 8192 --graphs-vs-eager --iters 10 --json "$OUT/fwd.jsonl" >> "$OUT/fwd.log" 2>&1
