source bench/device/setup.sh
L=$OUT/log.txt
git log --oneline | head -1 > $OUT/tree.txt
echo "== fp8 gpu tests" >> $L
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_moe_fp8.py tests/test_kernel_moe_w8a8.py -k "cuda or gpu" >> $L 2>&1
echo "== forward b64 bf16 profile" >> $L
timeout 120 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 --profile $OUT/profile64.txt --json $OUT/fwd.jsonl >> $L 2>&1
echo "== probe_score b64 8K" >> $L
timeout 60 python3 -m bench.probe_score --batch 64 --contexts 8192 --kinds bf16 --cold > $OUT/score.txt 2>&1
tail -15 $OUT/score.txt >> $L
echo "== probe_select b64 8K" >> $L
timeout 60 python3 -m bench.probe_select --batches 64 --widths 8192 > $OUT/select.txt 2>&1
tail -15 $OUT/select.txt >> $L
echo "== probe_mla b64 gather merge" >> $L
timeout 60 python3 -m bench.probe_mla --batches 64 --sections gather merge > $OUT/mla.txt 2>&1
tail -15 $OUT/mla.txt >> $L
echo done >> $L
