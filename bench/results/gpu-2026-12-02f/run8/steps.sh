source bench/device/setup.sh
L=$OUT/log.txt
cp kernels/tuned/NVIDIA_H200.json $OUT/table_before.json
for b in 64 16; do
  timeout 45 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 --json $OUT/fwd_before.jsonl > $OUT/fwd_before_$b.txt 2>&1
done
echo "== before" >> $L; cat $OUT/fwd_before.jsonl >> $L
echo "== tune bf16|topk" >> $L
timeout 170 python3 -m bench.tune_kernels --shapes 'bf16|topk' --json $OUT/tune.json > $OUT/tune.txt 2>&1
tail -12 $OUT/tune.txt >> $L
cp kernels/tuned/NVIDIA_H200.json $OUT/table_after.json
for b in 64 16; do
  timeout 45 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 --json $OUT/fwd_after.jsonl > $OUT/fwd_after_$b.txt 2>&1
done
echo "== after" >> $L; cat $OUT/fwd_after.jsonl >> $L
echo done >> $L
