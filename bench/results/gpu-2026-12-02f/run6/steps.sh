source bench/device/setup.sh
L=$OUT/log.txt
echo "== mla tests" >> $L
timeout 120 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_kernel_mla_decode.py -k "cuda" >> $L 2>&1
for b in 64 32; do
echo "== forward b$b (table: slots true) A/B slots false" >> $L
timeout 100 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 --mla-override '{"slots":false}' --json $OUT/fwd$b.jsonl > $OUT/fwd$b.txt 2>&1
cat $OUT/fwd$b.jsonl >> $L
done
echo "== forward b16 A/B slots true" >> $L
timeout 100 python3 -m bench.forward --batch 16 --contexts 8192 --iters 10 --mla-override '{"slots":true}' --json $OUT/fwd16.jsonl > $OUT/fwd16.txt 2>&1
cat $OUT/fwd16.jsonl >> $L
echo done >> $L
