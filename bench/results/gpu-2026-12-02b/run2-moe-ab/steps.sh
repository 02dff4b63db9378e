set -x
source bench/device/setup.sh
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 16"
K="python3 -m bench.kernel_moe_gemm --device cuda"
old() { (cd ab_old && PYTHONPATH=/tmp/site:$PWD "$@"); }
timeout 90 python3 -m pytest -q -x tests/test_kernel_moe_gemm.py > $OUT/gt.log 2>&1; echo "rc=$?" >> $OUT/gt.log
old timeout 50 $K > $OUT/k_old1.log 2>&1
timeout 50 $K > $OUT/k_new1.log 2>&1
old timeout 50 $K > $OUT/k_old2.log 2>&1
timeout 50 $K > $OUT/k_new2.log 2>&1
old timeout 50 $H --batches 1 --prompt-len 2048 > $OUT/p2048_old.log 2>&1
timeout 50 $H --batches 1 --prompt-len 2048 > $OUT/p2048_new.log 2>&1
old timeout 50 $H --batches 8 --prompt-len 512 > $OUT/b8p512_old.log 2>&1
timeout 50 $H --batches 8 --prompt-len 512 > $OUT/b8p512_new.log 2>&1
timeout 40 $H --batches 1 --prompt-len 2048 > $OUT/p2048_new2.log 2>&1
old timeout 40 $H --batches 1 --prompt-len 2048 > $OUT/p2048_old2.log 2>&1
