#!/usr/bin/env bash
# One GPU: what a prefill/decode hand-off costs a decoding batch (bench/handoff_overlap.py), the
# reservation withholding the blocks the step in flight writes against waiting for that step,
# after the async-scheduling GPU tests. Logs go to $OUT/logs.tar.gz; steps.txt has each command's
# exit status and seconds.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
L=$OUT/logs; mkdir -p "$L"
[ "${TESTS:-1}" = 0 ] || t 150 python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py \
  tests/test_pd_handoff.py -k "gpu or cuda or skips or withheld" > "$L/tests.log" 2>&1
t 200 python3 -m bench.handoff_overlap ${ARGS:---preset bench --batches 1 16 64 --steps 40 --rounds 3} > "$L/handoff.log" 2>&1
cp "$OUT/steps.txt" "$OUT/gpu.txt" "$L/"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/steps.txt"; tar xzf "$OUT/logs.tar.gz" -O logs/tests.log 2>/dev/null | tail -2
tar xzf "$OUT/logs.tar.gz" -O logs/handoff.log 2>/dev/null | grep -a '"mode"' | grep -v '"rows"'
