source bench/device/setup.sh
L=$OUT/log.txt
echo "== w8a8 gpu tests" >> $L
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_w8a8.py tests/test_moe_fp8.py tests/test_kernel_moe_fp8.py -k "cuda or gpu" -x >> $L 2>&1
tail -3 $L
echo "== probe bench built-in (bf16 / w8a16 / w8a8)" >> $L
timeout 80 python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --tokens 1 16 64 128 512 2048 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_builtin.txt >> $L
echo "== probe dsv3 built-in" >> $L
timeout 60 python3 -m bench.probe_moe --fp8 --act-fp8 --model dsv3 --built-in-only --tokens 16 64 128 --iters 20 > $OUT/probe_dsv3.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_dsv3.txt >> $L
echo "== forward" >> $L
for b in 64; do
timeout 120 python3 -m bench.forward --batch $b --contexts 8192 --iters 10 --expert-dtype auto fp8_e4m3 fp8_w8a8 --json $OUT/fwd.jsonl >> $L 2>&1
done
echo done >> $L
