#!/usr/bin/env bash
# One GPU: what a prefill/decode hand-off costs a decoding batch (bench/handoff_overlap.py), the
# reservation withholding the blocks the step in flight writes against waiting for that step,
# after the async-scheduling GPU tests. AGREE=1 adds the step agreement's host time of groups of
# 2-8 ranks on one host (shared memory), on fake hosts of 2 ranks (TCP between them, over
# loopback) and over gloo (agree.log). Logs go to $OUT as each step ends (a run cut short keeps
# what it finished); steps.txt has each command's exit status and seconds.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
L=$OUT
[ "${TESTS:-1}" = 0 ] || t 150 python3 -m pytest -q -p no:cacheprovider tests/test_async_scheduling.py \
  tests/test_pd_handoff.py tests/test_ep_step.py -k "gpu or cuda or skips or withheld" > "$L/tests.log" 2>&1
t 150 python3 -m bench.handoff_overlap ${ARGS:---preset bench --batches 1 16 64 --steps 40 --rounds 3} > "$L/handoff.log" 2>&1
[ "${AGREE:-0}" = 0 ] || t 120 python3 -m bench.agree_latency --forms shm hosts gloo --worlds 2 4 8 \
  --iters 1000 > "$L/agree.log" 2>&1
cat "$OUT/steps.txt"; tail -2 "$L/tests.log" 2>/dev/null
cat "$L"/*.log | grep -a '"mode"\|"form"' | grep -v '"rows"'
