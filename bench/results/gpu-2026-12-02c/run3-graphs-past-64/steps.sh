source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
old() { (cd ab_old && PYTHONPATH=/tmp/site:$PWD "$@"); }
t 200 python3 -m pytest -q -x tests/test_decode_path.py -k "cuda or gpu or past_64" > "$OUT/gt.log" 2>&1
t 100 python3 -m pytest -q -x tests/test_async_scheduling.py tests/test_chunk_rows.py -k cuda >> "$OUT/gt.log" 2>&1
for b in 128 256; do
  t 120 python3 -m bench.forward --batch $b --contexts 8192 --graphs-vs-eager --iters 10 --json "$OUT/fwd.jsonl" >> "$OUT/fwd.log" 2>&1
done
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 32 --batches 128 --prompt-len 64"
echo "== old" >> "$OUT/e2e.log"; t 120 old $H >> "$OUT/e2e.log" 2>&1
echo "== new" >> "$OUT/e2e.log"; t 120 $H >> "$OUT/e2e.log" 2>&1
