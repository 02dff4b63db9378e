source bench/device/setup.sh
L=$OUT/log.txt
echo "== w8a8 gpu tests" >> $L
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_w8a8.py tests/test_moe_fp8.py -k "cuda or gpu" >> $L 2>&1
echo "== probe bench built-in (bf16 / w8a16 / w8a8), FP8_PRECISE_ACC 32" >> $L
timeout 70 python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --tokens 1 16 64 128 512 2048 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_builtin.txt >> $L
echo "== probe bench built-in w8a8, FP8_PRECISE_ACC 0" >> $L
timeout 50 python3 -m bench.probe_moe --fp8 --act-fp8 --fp8-acc 0 --built-in-only --tokens 64 512 2048 --iters 20 > $OUT/probe_acc0.txt 2>&1
grep -E '"built-in"|rror' $OUT/probe_acc0.txt >> $L
echo "== probe dsv3 built-in" >> $L
timeout 50 python3 -m bench.probe_moe --fp8 --act-fp8 --model dsv3 --built-in-only --tokens 16 64 128 --iters 20 > $OUT/probe_dsv3.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_dsv3.txt >> $L
echo "== forward" >> $L
for b in 64 128; do
timeout 110 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 --expert-dtype auto fp8_e4m3 fp8_w8a8 --json $OUT/fwd.jsonl >> $L 2>&1
done
echo done >> $L
