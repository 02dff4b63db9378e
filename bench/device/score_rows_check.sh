#!/usr/bin/env bash
# Prompt rows scored several to a program (wideep_kernels/index_score_rows.py) on a GPU: its tests
# and the indexer's, the probe against the row-by-row launch, and a long prompt's prefill against
# the tree before it (.devpack/tree_old.tgz, `git archive <old> -- . ':!bench/results' ':!tests'`),
# in turns. Carry .devpack/pydantic-site.tgz too.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
t 150 python3 -m pytest -q -p no:cacheprovider -k cuda ${TESTS:-tests/test_kernel_score_rows.py tests/test_kernel_indexer.py \
  tests/test_kernel_score_maxima.py tests/test_chunk_rows.py} > "$OUT/tests.log" 2>&1
tail -n 2 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
t 200 python3 -m bench.probe_score_rows --contexts 8192 32768 100000 --mixed --kinds bf16 fp8 \
  --choices ${CHOICES:-64:4 128:8} --rows-per-program ${RPP:-0 8} ${NO_FUSED---no-fused} --json "$OUT/probe.jsonl" > "$OUT/probe.log" 2>&1
grep -a "^|" "$OUT/probe.log"
mkdir -p /tmp/old && tar xzf .devpack/tree_old.tgz -C /tmp/old
P="--contexts 32768 100000 --chunks 1024 --repeats 2"
(cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old t 100 python3 -m bench.prefill_long $P > "$OUT/old1.log" 2>&1)
t 100 python3 -m bench.prefill_long $P --profile "$OUT/new_profile.md" > "$OUT/new1.log" 2>&1
for f in old1 new1; do echo "== $f"; grep -a "^| [0-9]" "$OUT/$f.log"; done
head -n 14 "$OUT/new_profile.md"
cat "$OUT/steps.txt"
