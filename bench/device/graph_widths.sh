#!/usr/bin/env bash
# One GPU: the shared short-context graph width (bench/graph_widths.py: a step's cost at that
# width against its own, and the captures met while serving with and without it), after the
# decode-path GPU tests (TESTS=0: none; TESTS="pytest args": those instead). HANDOFF=1 adds the
# hand-off bench (bench/handoff_overlap.py). AB=1 then runs the bench again on the files kept in
# .devpack/old (the tree before a change, same paths), for a side-by-side in one machine session.
# Logs go to $OUT as each step ends; steps.txt has each command's exit status and seconds.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
if [ "${TESTS:-1}" = 1 ]; then
  t 200 python3 -m pytest -q -p no:cacheprovider tests/test_decode_path.py tests/test_async_scheduling.py \
    -k "gpu or cuda or graph or short" > "$OUT/tests.log" 2>&1
  t 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_mla_decode.py -k "cuda and (gluon or dense)" \
    > "$OUT/tests_mla.log" 2>&1
elif [ "${TESTS:-1}" != 0 ]; then
  t "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
fi
t "${BENCH_S:-300}" python3 -m bench.graph_widths ${ARGS:---preset bench --batches 1 16 64} > "$OUT/graph_widths.log" 2>&1
if [ "${AB:-0}" != 0 ]; then
  cp -r .devpack/old/. .
  t "${BENCH_S:-300}" python3 -m bench.graph_widths ${ARGS:---preset bench --batches 1 16 64} \
    > "$OUT/graph_widths_old.log" 2>&1
fi
[ "${HANDOFF:-0}" = 0 ] || t 150 python3 -m bench.handoff_overlap --preset bench --batches 1 16 64 --steps 40 \
  --rounds 3 > "$OUT/handoff.log" 2>&1
cat "$OUT/steps.txt"; tail -3 "$OUT"/tests*.log 2>/dev/null
for f in "$OUT"/graph_widths*.log; do echo "== $f"; grep -a '"part"\|"mode"' "$f" | grep -v '"rows"'; done
