source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 170 python3 -m pytest -q tests/test_kernel_moe_w8a8.py -k cuda > $OUT/t_w8a8.txt 2>&1; echo "rc $?" >> $OUT/t_w8a8.txt
timeout 100 python3 -m pytest -q tests/test_moe_fp8.py -k "cuda or gpu" > $OUT/t_moe_fp8.txt 2>&1; echo "rc $?" >> $OUT/t_moe_fp8.txt
F="python3 -m bench.forward --contexts 8192 --iters 20"
cp kernels/moe_gemm.py /tmp/mg.py
sed -i 's/        cfg = cfg._replace(x_in_tile=True)/        pass/' kernels/moe_gemm.py
grep -c "x_in_tile=True" kernels/moe_gemm.py > $OUT/fwd_launch.txt
timeout 100 $F --batch 1 --expert-dtype fp8_w8a8 >> $OUT/fwd_launch.txt 2>&1
cp /tmp/mg.py kernels/moe_gemm.py
timeout 130 $F --batch 1 --expert-dtype auto fp8_e4m3 fp8_w8a8 > $OUT/fwd_b1.txt 2>&1; echo "rc $?" >> $OUT/fwd_b1.txt
timeout 130 $F --batch 64 --expert-dtype auto fp8_e4m3 fp8_w8a8 > $OUT/fwd_b64.txt 2>&1; echo "rc $?" >> $OUT/fwd_b64.txt
echo done > $OUT/done.txt
