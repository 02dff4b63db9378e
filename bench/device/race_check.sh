#!/usr/bin/env bash
# The one-pass sampling kernel (wideep_kernels/race.py) on a GPU: its tests, then the sampler's
# device time against the tree before it, in turns (two each). Carry .devpack/pydantic-site.tgz
# and .devpack/tree_old.tgz, made with
#   git archive bead8c8 -- . ':!bench/results' ':!tests' | gzip > .devpack/tree_old.tgz
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
t 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_race.py tests/test_sampling.py > "$OUT/tests.log" 2>&1
tail -n 3 "$OUT/tests.log"; grep -a FAILED "$OUT/tests.log"
mkdir -p /tmp/old && tar xzf .devpack/tree_old.tgz -C /tmp/old
S="--device cuda --batches 1 16 64 --vocab 129280 --kinds temperature top_k=50 top_p=0.9 top_k+top_p penalties"
for i in 1 2; do
  (cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old t 60 python3 -m bench.sampling $S > "$OUT/old$i.log" 2>&1)
  t 60 python3 -m bench.sampling $S > "$OUT/new$i.log" 2>&1
done
for f in old1 new1 old2 new2; do echo "== $f"; grep -a "^| 129280" "$OUT/$f.log"; done
cat "$OUT/steps.txt"
