#!/usr/bin/env bash
# The forty-second session's kernel changes on a GPU against the tree before them
# (.devpack/tree_old.tgz, `git archive <old> -- . ':!bench/results' ':!tests'`): GPU tests, the grouped
# scoring probe, a 32K prompt's prefill (in turns) and a batch-256 decode step, then a profile of the
# new tree's prefill. Carry .devpack/pydantic-site.tgz too.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
mkdir -p /tmp/old && tar xzf .devpack/tree_old.tgz -C /tmp/old
old() { (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old "$@"); }
t 150 python3 -m pytest -q -p no:cacheprovider -k "cuda and (gluon or rows or group)" tests/test_kernel_mla_decode.py \
  tests/test_kernel_score_rows.py > "$OUT/tests.log" 2>&1
tail -n 2 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
PROBE="-m bench.probe_score_rows --contexts 32768 100000 --mixed --kinds bf16 fp8 --choices 64:4"
old t 80 python3 $PROBE > "$OUT/probe_old.log" 2>&1
t 80 python3 $PROBE > "$OUT/probe_new.log" 2>&1
P="-m bench.prefill_long --contexts 32768 --chunks 1024 --repeats 2"
F="-m bench.forward --batch 256 --contexts 8192 --iters 10"
for i in 1 2; do
  old t 60 python3 $P > "$OUT/prefill_old$i.log" 2>&1
  t 60 python3 $P > "$OUT/prefill_new$i.log" 2>&1
done
old t 60 python3 $F > "$OUT/fwd_old.log" 2>&1
t 60 python3 $F > "$OUT/fwd_new.log" 2>&1
t 80 python3 $P --profile "$OUT/profile.md" > "$OUT/prefill_profile.log" 2>&1
for f in probe_old probe_new; do echo "== $f"; grep -a "^|" "$OUT/$f.log"; done
for f in prefill_old1 prefill_new1 prefill_old2 prefill_new2 fwd_old fwd_new; do echo "== $f"; grep -a "^| [0-9a]" "$OUT/$f.log"; done
head -n 30 "$OUT/profile.md"
cat "$OUT/steps.txt"
cd "$OUT" && tar czf /tmp/all.tgz . && rm -rf "$OUT"/* && mv /tmp/all.tgz "$OUT/"
