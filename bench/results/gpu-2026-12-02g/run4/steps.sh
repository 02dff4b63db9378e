source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
T="python3 -m pytest -q -x"
timeout 60 $T tests/test_kernel_moe_w8a8.py -k "cuda or gpu" > $OUT/t_w8a8.txt 2>&1; echo "rc $?" >> $OUT/t_w8a8.txt
timeout 90 $T tests/test_moe_fp8.py -k "cuda or gpu" > $OUT/t_moe_fp8.txt 2>&1; echo "rc $?" >> $OUT/t_moe_fp8.txt
timeout 60 $T tests/test_kernel_moe_fp8.py -k "cuda and chunk" > $OUT/t_kfp8.txt 2>&1; echo "rc $?" >> $OUT/t_kfp8.txt
timeout 60 $T tests/test_kernel_moe_gemm.py -k "cuda and (pair_rows or built_in)" > $OUT/t_gemm.txt 2>&1; echo "rc $?" >> $OUT/t_gemm.txt
P="python3 -m bench.probe_moe --built-in-only --pair-rows-ab --iters 20"
timeout 50 $P --tokens 64 128 256 > $OUT/bf16_small.txt 2>&1
timeout 60 $P --fp8 --act-fp8 --tokens 128 256 > $OUT/w8a8_small.txt 2>&1
timeout 120 $T tests/test_decode_path.py -k "cuda or gpu" > $OUT/t_decode.txt 2>&1; echo "rc $?" >> $OUT/t_decode.txt
echo done > $OUT/done.txt
