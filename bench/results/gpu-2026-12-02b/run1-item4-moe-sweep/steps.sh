set -x
source bench/device/setup.sh
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 16 --batches 1 --prompt-len 2048"
timeout 110 python3 -m pytest -q -x tests/test_chunk_rows.py -k cuda > $OUT/gt.log 2>&1; echo "rc=$?" >> $OUT/gt.log
timeout 45 $H > $OUT/p2048g.log 2>&1
timeout 45 $H --max-chunk 512 > $OUT/p2048e.log 2>&1
(cd ab_old && PYTHONPATH=/tmp/site:$PWD timeout 45 $H > $OUT/p2048old.log 2>&1)
timeout 45 $H > $OUT/p2048g2.log 2>&1
timeout 110 python3 -m bench.probe_moe --prefill --tokens 512 --block-m 32 64 --iters 20 > $OUT/moe512.log 2>&1
timeout 150 python3 -m bench.probe_moe --prefill --tokens 2048 --block-m 64 128 --iters 20 > $OUT/moe2048.log 2>&1
grep '"built_in_us"' $OUT/moe*.log
