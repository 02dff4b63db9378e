source bench/device/setup.sh
L=$OUT/log.txt
echo "== gpu tests" >> $L
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_moe_fp8.py tests/test_kernel_moe_fp8.py tests/test_decode_path.py -k "cuda or gpu or past_64" >> $L 2>&1
for b in 64 1 16 128; do
  extra=""; [ $b = 64 ] && extra="--moe-share"
  echo "== forward batch $b" >> $L
  timeout 150 python3 -m bench.forward --batch $b --contexts 8192 --expert-dtype auto fp8_e4m3 $extra --json $OUT/forward.jsonl > $OUT/forward_$b.txt 2>&1
  tail -4 $OUT/forward_$b.txt >> $L
done
