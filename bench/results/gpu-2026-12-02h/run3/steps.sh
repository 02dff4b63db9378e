source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 150 python3 -m pytest -q tests/test_checkpoint_fp8.py tests/test_moe_fp8.py -k "gpu or cuda" > $OUT/tests.txt 2>&1; echo "rc $?" >> $OUT/tests.txt
timeout 170 python3 exp_prefill.py > $OUT/prefill.txt 2>&1; echo "rc $?" >> $OUT/prefill.txt
P="python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --iters 20"
timeout 100 $P --tokens 512 1024 2048 > $OUT/probe_bench.txt 2>&1; echo "rc $?" >> $OUT/probe_bench.txt
timeout 80 $P --model dsv3 --tokens 128 512 > $OUT/probe_dsv3.txt 2>&1; echo "rc $?" >> $OUT/probe_dsv3.txt
timeout 50 $P --fp8-acc 32 --tokens 2048 > $OUT/probe_acc32.txt 2>&1; echo "rc $?" >> $OUT/probe_acc32.txt
echo done > $OUT/done.txt
