source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
python3 -m pip install -q --no-deps --no-compile --target /tmp/fisite .devpack/flashinfer_python-*.whl > "$OUT/flashinfer.log" 2>&1
export PYTHONPATH=/tmp/fisite:$PYTHONPATH TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
for r in 1 2; do
  echo "=== round $r" >> "$OUT/flashinfer.log"
  t 300 python3 -m bench.flashinfer_mla --batches 1 4 16 32 64 128 --backends fa2 fa3 --window 128 --json "$OUT/flashinfer.jsonl" >> "$OUT/flashinfer.log" 2>&1
done
