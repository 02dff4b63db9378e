source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 200 python3 exp_acc.py > $OUT/acc.txt 2>&1; echo "rc $?" >> $OUT/acc.txt
F="python3 -m bench.forward --contexts 8192 --iters 20 --expert-dtype auto fp8_e4m3 fp8_w8a8"
timeout 170 $F --batch 1 > $OUT/fwd_b1.txt 2>&1; echo "rc $?" >> $OUT/fwd_b1.txt
timeout 170 $F --batch 16 > $OUT/fwd_b16.txt 2>&1; echo "rc $?" >> $OUT/fwd_b16.txt
echo done > $OUT/done.txt
