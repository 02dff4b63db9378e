#!/usr/bin/env bash
# The threshold select's changes (wideep_kernels/wide_select.py) on a GPU against the tree before
# them (.devpack/tree_old.tgz, `git archive <old> -- . ':!bench/results' ':!tests'`): its GPU tests;
# the prompt probe at wide chunks, old tree then new with its variants (PROBE_ONLY: the choices'
# prefixes); decode rows of 128K-512K, radix against threshold (STEPS "wide"); the prompt rows'
# scoring choices (STEPS "rows", ROWS_CHOICES); 100K prompts' prefill, old tree then the new under VARIANTS (each a set of WIDEEP_*
# switches); batch-16 decode steps at 128K and 512K, old and new. Carry .devpack/pydantic-site.tgz too.
source bench/device/setup.sh
source bench/device/ab.sh
if on tests; then
  t 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_wide_select.py tests/test_kernel_score_maxima.py \
    > "$OUT/tests.log" 2>&1
  t 120 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_kernel_indexer.py \
    tests/test_kernel_score_rows.py >> "$OUT/tests.log" 2>&1
  grep -a -E "passed|failed" "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
fi
W=${PROBE_WIDTHS:-32768 65536 131072}
if on probe; then
  old t 120 python3 -m bench.probe_select --prompt --batches 1024 --widths $W --iters 10 \
    --json "$OUT/probe_old.jsonl" > "$OUT/probe_old.log" 2>&1
  t 120 python3 -m bench.probe_select --prompt --batches 1024 --widths $W --iters 10 --only ${PROBE_ONLY:-threshold topk split} \
    --json "$OUT/probe_new.jsonl" > "$OUT/probe_new.log" 2>&1
  grep -a -E "^\| (choice|threshold|topk|split) " "$OUT/probe_old.log"; grep -a "^|" "$OUT/probe_new.log"
fi
if on wide; then  # decode rows of 128K-512K: radix passes against the threshold select, old tree then new
  WA="-m bench.probe_select --wide --batches ${WIDE_BATCHES:-1 4 16} --widths 131072 524288 --iters 10"
  old t 120 python3 $WA --json "$OUT/wide_old.jsonl" > "$OUT/wide_old.log" 2>&1
  t 120 python3 $WA --json "$OUT/wide_new.jsonl" > "$OUT/wide_new.log" 2>&1
  for f in old new; do echo "== wide $f"; grep -a -E '"choice": "(kth|select)_' "$OUT/wide_$f.log" | tail -n 40; done
fi
if on rows; then  # the prompt rows' scoring, its launch choices (tile:warps:stages)
  t 200 python3 -m bench.probe_score_rows --contexts ${ROWS_CONTEXTS:-32768 100000} --kinds bf16 fp8 \
    --choices ${ROWS_CHOICES:-64:4:1 64:4:2 64:4:3 64:8:3} --json "$OUT/probe_rows.jsonl" > "$OUT/probe_rows.log" 2>&1
  grep -a "^|" "$OUT/probe_rows.log"
fi
if on prefill; then
  ROUNDS=${ROUNDS:-1} prefill_rounds 150 --contexts ${PREFILL_CONTEXTS:-100000} --chunks 1024 --repeats 2
fi
if on forward; then
  F="-m bench.forward --batch ${FWD_BATCH:-16} --contexts ${FWD_CONTEXTS:-131072 524288} --iters 10"
  old t 120 python3 $F > "$OUT/fwd_old.log" 2>&1
  t 120 python3 $F > "$OUT/fwd_new.log" 2>&1
  for f in old new; do echo "== $f"; grep -a "^| [0-9a]" "$OUT/fwd_$f.log"; done
fi
cat "$OUT/steps.txt"
cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf "$OUT"/* && mv /tmp/all.tgz "$OUT/"
