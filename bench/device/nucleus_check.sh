#!/usr/bin/env bash
# One GPU, a few minutes, the most wanted first (a run cut short keeps what it wrote): the nucleus
# kernel's GPU tests and its cost against the sort (bench.sampling at DeepSeek's vocabulary), then
# structured output's GPU tests and its decode steps (bench.structured). Carry
# .devpack/pydantic-site.tgz (bench/device/pack_pydantic.sh).
# With .devpack/nucleus_old.py (an earlier tree's wideep_kernels/nucleus.py, e.g. `git show
# eabfeb8:wideep_kernels/nucleus.py`), the kernel alone is first timed against it, with each
# chunks-a-program choice (bench/nucleus_ab.py).
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
if [ -f .devpack/nucleus_old.py ]; then
  cp .devpack/nucleus_old.py wideep_kernels/nucleus_old.py
  t 90 python3 -m bench.nucleus_ab --other wideep_kernels.nucleus_old --per-program 1 2 4 8 16 32 \
    --json "$OUT/nucleus_ab.jsonl" > "$OUT/nucleus_ab.log" 2>&1
  cat "$OUT/nucleus_ab.log"
fi
t 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_nucleus.py tests/test_sampling.py > "$OUT/tests.log" 2>&1
tail -n 3 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
t 100 python3 -m bench.sampling --device cuda --batches 1 16 64 --vocab 129280 \
  --kinds temperature top_k=50 top_p=0.9 top_k+top_p --json "$OUT/sampling.jsonl" > "$OUT/sampling.log" 2>&1
cat "$OUT/sampling.log"
t 120 python3 -m pytest -q -p no:cacheprovider tests/test_structured_output.py tests/test_call_grammars.py \
  > "$OUT/structured_tests.log" 2>&1
tail -n 3 "$OUT/structured_tests.log"; grep -a FAILED "$OUT/structured_tests.log"
t 200 python3 -m bench.structured --device cuda --vocab 129280 --batches 1 16 64 --steps 20 \
  --engine-preset bench --engine-steps 30 --json "$OUT/structured.jsonl" > "$OUT/structured.log" 2>&1
cat "$OUT/structured.log" "$OUT/steps.txt"
