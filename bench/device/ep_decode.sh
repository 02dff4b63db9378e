#!/usr/bin/env bash
# One GPU: the expert-parallel GPU tests, then one EP rank's decode step against the plain engine
# (bench/ep_decode.py): modes `ep` (agreement on a host group, steps launched ahead), `ep-nccl`
# (agreement over NCCL, no step ahead) and `plain`, each in its own process, ROUNDS times in turn;
# where an older tree is unpacked at $OLD (`git archive REV engine wideep_kernels bench | tar -x -C $OLD`;
# trees before the package rename name `kernels` instead),
# its `ep` mode too. TESTS=0 skips the tests; PROFILE=1 adds a kernel table of one eager step per mode
# at batches 1 and 16 (profile.txt); MIXED=N adds `--mixed N` over the three modes (mixed.log);
# AGREE=1 times the host agreement of groups of 1-8 ranks (agree.log). Logs go to $OUT, all of
# them into $OUT/logs.tar.gz at the end; steps.txt has each command's exit status and seconds.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
ARGS=${ARGS:---preset bench --batches 1 16 64 --steps 40}
L=$OUT/logs; mkdir -p "$L"
[ "${TESTS:-1}" = 0 ] || t 300 python3 -m pytest -q -p no:cacheprovider tests/test_ep_step.py tests/test_kernel_moe_gemm.py \
  tests/test_kernel_routing.py tests/test_async_scheduling.py tests/test_chunk_rows.py \
  -k "gpu or (cuda and (dropped or shared or padding or pair_rows or align))" > "$L/tests.log" 2>&1
for round in $(seq 1 "${ROUNDS:-2}"); do
  for mode in ep ep-nccl plain; do
    t 150 python3 -m bench.ep_decode $ARGS --modes $mode > "$L/$mode$round.log" 2>&1
  done
  if [ -n "$OLD" ]; then
    (cd "$OLD" && PYTHONPATH=/tmp/site:$PWD t 150 python3 -m bench.ep_decode $ARGS --modes ep) > "$L/old$round.log" 2>&1
  fi
done
if [ "${MIXED:-0}" != 0 ]; then
  t 200 python3 -m bench.ep_decode --preset bench --batches 1 16 64 --steps 20 --mixed "$MIXED" \
    --modes plain ep ep-nccl > "$L/mixed.log" 2>&1
fi
[ "${AGREE:-0}" = 0 ] || t 200 python3 -m bench.agree_latency --worlds 1 2 4 8 --iters 2000 > "$L/agree.log" 2>&1
if [ "${PROFILE:-0}" = 1 ]; then
  t 150 python3 -m bench.ep_decode --preset bench --batches 1 16 --steps 10 --modes plain ep \
    --profile "$L/profile.txt" > "$L/profile.log" 2>&1
fi
cp "$OUT/steps.txt" "$OUT/gpu.txt" "$L/"
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/steps.txt"; tar xzf "$OUT/logs.tar.gz" -O logs/tests.log 2>/dev/null | tail -2
tar xzf "$OUT/logs.tar.gz" -O 2>/dev/null | grep -a '"mode"\|"world"' | grep -v '"rows"'
