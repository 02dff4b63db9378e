source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
P="python3 -m bench.probe_moe --fp8 --act-fp8"
timeout 110 python3 -m pytest -q -x tests/test_kernel_moe_w8a8.py -k "cuda or gpu" > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
timeout 90 $P --built-in-only --kernels --tokens 512 1024 2048 --iters 20 > $OUT/builtin.txt 2>&1
timeout 50 python3 -m bench.probe_moe --fp8 --kernels --built-in-only --tokens 2048 --iters 20 >> $OUT/builtin.txt 2>&1
for acc in 64 0; do timeout 45 $P --built-in-only --tokens 2048 --fp8-acc $acc --iters 20 > $OUT/acc$acc.txt 2>&1; done
timeout 230 $P --prefill --tokens 2048 --block-m 64 --stages 3 4 --iters 10 > $OUT/sweep64.txt 2>&1
echo done > $OUT/done.txt
