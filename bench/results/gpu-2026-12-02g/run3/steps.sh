source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 200 python3 -m pytest -q tests/test_kernel_moe_gemm.py tests/test_kernel_moe_fp8.py tests/test_kernel_moe_w8a8.py tests/test_moe_fp8.py -k "cuda or gpu" > $OUT/tests.txt 2>&1; echo "tests rc $?" >> $OUT/tests.txt
P="python3 -m bench.probe_moe --built-in-only --pair-rows-ab --iters 20"
timeout 80 $P --tokens 512 1024 2048 > $OUT/bf16.txt 2>&1
timeout 100 $P --fp8 --act-fp8 --kernels --tokens 512 1024 2048 > $OUT/w8a8.txt 2>&1
timeout 80 $P --fp8 --tokens 512 2048 > $OUT/fp8w.txt 2>&1
timeout 100 $P --model dsv3 --fp8 --act-fp8 --tokens 128 512 > $OUT/dsv3.txt 2>&1
timeout 60 python3 -m pytest -q tests/test_decode_path.py -k "cuda or gpu" > $OUT/tests2.txt 2>&1; echo "tests rc $?" >> $OUT/tests2.txt
echo done > $OUT/done.txt
