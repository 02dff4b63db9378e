#!/usr/bin/env bash
# One GPU: the expert-parallel GPU tests, then one EP rank's decode step against the plain engine
# (bench/ep_decode.py), and, where an older tree is unpacked at $OLD (`git archive REV engine
# kernels bench | tar -x -C $OLD`), the same benchmark over it, the two trees and the plain engine in turn ROUNDS times.
# TESTS=0 skips the tests; PROFILE=1 adds a kernel table of one eager step per mode at batches 1
# and 16 (profile.txt). Logs go to $OUT; steps.txt has each command's exit status and seconds.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
ARGS=${ARGS:---preset bench --batches 1 16 64 --steps 40}
[ "${TESTS:-1}" = 0 ] || t 240 python3 -m pytest -q -p no:cacheprovider tests/test_ep_step.py tests/test_kernel_moe_gemm.py \
  tests/test_kernel_routing.py -k "gpu or (cuda and (dropped or shared or padding or pair_rows or align))" \
  > "$OUT/tests.log" 2>&1
for round in $(seq 1 "${ROUNDS:-2}"); do
  t 150 python3 -m bench.ep_decode $ARGS --modes ep > "$OUT/new$round.log" 2>&1
  if [ -n "$OLD" ]; then
    (cd "$OLD" && PYTHONPATH=/tmp/site:$PWD t 150 python3 -m bench.ep_decode $ARGS --modes ep) > "$OUT/old$round.log" 2>&1
  fi
  t 120 python3 -m bench.ep_decode $ARGS --modes plain > "$OUT/plain$round.log" 2>&1
done
if [ "${PROFILE:-0}" = 1 ]; then
  t 150 python3 -m bench.ep_decode --preset bench --batches 1 16 --steps 10 --modes plain ep \
    --profile "$OUT/profile.txt" > "$OUT/profile.log" 2>&1
fi
cat "$OUT/steps.txt"; tail -2 "$OUT/tests.log"; grep -h '"rows"' "$OUT"/*.log
