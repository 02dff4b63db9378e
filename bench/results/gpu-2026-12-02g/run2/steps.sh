source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 200 python3 exp_moe.py > $OUT/base.txt 2>&1
sed -i 's/    tl.atomic_add(out_ptrs, acc, mask=is_pair\[:, None\] & col_ok\[None, :\])/    tl.store(out_ptrs, acc, mask=is_pair[:, None] \& col_ok[None, :])/' kernels/moe_gemm.py
grep -n "tl.store(out_ptrs, acc" kernels/moe_gemm.py > $OUT/stores.txt
timeout 150 python3 exp_moe.py --timing-only > $OUT/stores.txt 2>&1
git checkout kernels/moe_gemm.py
echo done > $OUT/done.txt
