source bench/device/setup.sh
L=$OUT/log.txt
echo "== gpu tests" >> $L
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_checkpoint_fp8.py tests/test_moe_fp8.py -k "gpu" >> $L 2>&1
echo "== prefill kernels" >> $L
timeout 90 python3 -m bench.probe_moe --fp8 --built-in-only --tokens 512 2048 --iters 20 > $OUT/probe_prefill.txt 2>&1
grep -E 'built-in' $OUT/probe_prefill.txt >> $L
echo "== load memory" >> $L
timeout 170 python3 -m bench.load_memory --preset bench --dir /tmp/ckpt --fp8-block 128 128 --json $OUT/load.jsonl >> $L 2>&1
(cd ab_old && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m bench.load_memory --preset bench --dir /tmp/ckpt --fp8-block 128 128 --expert-dtype auto --json $OUT/load_old.jsonl) >> $L 2>&1
