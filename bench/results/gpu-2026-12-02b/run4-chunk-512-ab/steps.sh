source bench/device/setup.sh
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 16"
K="python3 -m bench.kernel_moe_gemm --device cuda"
old() { (cd ab_old && PYTHONPATH=/tmp/site:$PWD "$@"); }
echo "# new 1" >> $OUT/k.log; timeout 80 $K >> $OUT/k.log 2>&1
echo "# old 1" >> $OUT/k.log; old timeout 80 $K >> $OUT/k.log 2>&1
for i in 1 2; do
  echo "# old $i" >> $OUT/p512.log; old timeout 60 $H --batches 1 --prompt-len 512 >> $OUT/p512.log 2>&1
  echo "# new $i" >> $OUT/p512.log; timeout 60 $H --batches 1 --prompt-len 512 >> $OUT/p512.log 2>&1
done
echo "# new 1" >> $OUT/p1024x2.log; timeout 60 $H --batches 2 --prompt-len 1024 >> $OUT/p1024x2.log 2>&1
echo "# old 1" >> $OUT/p1024x2.log; old timeout 60 $H --batches 2 --prompt-len 1024 >> $OUT/p1024x2.log 2>&1
