#!/usr/bin/env bash
# The indexer selection's changes on a GPU against the tree before them (.devpack/tree_old.tgz,
# `git archive <old> -- . ':!bench/results' ':!tests'`): GPU tests of the selection; the prompt probe
# (bench.probe_select --prompt) and the decode rows' probe at 64-256 rows; 32K and 100K prompts'
# prefill, old tree and the new under VARIANTS (each a set of WIDEEP_* switches), in two rounds;
# decode steps at batch 64 and 256. Carry .devpack/pydantic-site.tgz too.
source bench/device/setup.sh
source bench/device/ab.sh
if on tests; then
  t 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_row_select.py > "$OUT/tests.log" 2>&1
  [ -n "$INDEXER_TESTS" ] && t 120 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" \
    tests/test_kernel_indexer.py >> "$OUT/tests.log" 2>&1
  tail -n 2 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
fi
if on probe; then
  t 150 python3 -m bench.probe_select --prompt --batches 1024 --widths ${PROBE_WIDTHS:-16384 32768 131072} --iters 10 \
    --json "$OUT/probe_prompt.jsonl" > "$OUT/probe_prompt.log" 2>&1
  t 60 python3 -m bench.probe_select --batches ${DECODE_ROWS:-64 128 256} --widths 10240 --iters 10 \
    --json "$OUT/probe_decode.jsonl" > "$OUT/probe_decode.log" 2>&1
  grep -a "^|" "$OUT/probe_prompt.log" "$OUT/probe_decode.log" || tail -n 5 "$OUT"/probe_*.log
fi
if on prefill; then
  ROUNDS=${ROUNDS:-1 2} prefill_rounds 90 --contexts ${PREFILL_CONTEXTS:-32768 100000} --chunks 1024 --repeats 2
fi
if on forward; then
  for b in ${FWD_BATCHES:-64 256}; do
    F="-m bench.forward --batch $b --contexts 8192 --iters 10"
    old t 60 python3 $F > "$OUT/fwd_old_b$b.log" 2>&1
    t 60 python3 $F > "$OUT/fwd_new_b$b.log" 2>&1
    for f in old new; do echo "== $f b$b"; grep -a "^| [0-9a]" "$OUT/fwd_${f}_b$b.log"; done
  done
fi
cat "$OUT/steps.txt"
cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf "$OUT"/* && mv /tmp/all.tgz "$OUT/"
