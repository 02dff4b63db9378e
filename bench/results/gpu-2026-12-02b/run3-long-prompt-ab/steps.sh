source bench/device/setup.sh
H="python3 -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --skip-hf --gen 16"
old() { (cd ab_old && PYTHONPATH=/tmp/site:$PWD "$@"); }
for i in 1 2; do
  echo "# old $i" >> $OUT/p2048.log; old timeout 70 $H --batches 1 --prompt-len 2048 >> $OUT/p2048.log 2>&1
  echo "# new $i" >> $OUT/p2048.log; timeout 70 $H --batches 1 --prompt-len 2048 >> $OUT/p2048.log 2>&1
done
echo "# new 2" >> $OUT/b8p512.log; timeout 60 $H --batches 8 --prompt-len 512 >> $OUT/b8p512.log 2>&1
echo "# old 2" >> $OUT/b8p512.log; old timeout 60 $H --batches 8 --prompt-len 512 >> $OUT/b8p512.log 2>&1
