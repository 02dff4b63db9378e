source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
F="python3 -m bench.forward --batch 256 --contexts 8192 --iters 10"
timeout 130 $F > $OUT/fwd_new.txt 2>&1
sed -i 's/    if cfg.block_m >= 32:/    if cfg.block_m >= 64:/' kernels/moe_gemm.py
grep -n "cfg.block_m >= 64:" kernels/moe_gemm.py >> $OUT/fwd_old.txt
timeout 130 $F >> $OUT/fwd_old.txt 2>&1
git checkout kernels/moe_gemm.py
timeout 120 python3 -m pytest -q -x tests/test_kernel_moe_fp8.py -k "cuda and chunk" > $OUT/t_kfp8.txt 2>&1; echo "rc $?" >> $OUT/t_kfp8.txt
echo done > $OUT/done.txt
