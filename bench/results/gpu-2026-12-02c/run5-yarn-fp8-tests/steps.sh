source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
t 300 python3 -m pytest -q -x tests/test_rope_yarn.py tests/test_checkpoint_fp8.py -k "gpu" > "$OUT/gt.log" 2>&1
t 200 python3 -m pytest -q -x tests/test_rope_yarn.py tests/test_checkpoint_fp8.py tests/test_checkpoint.py >> "$OUT/gt.log" 2>&1
