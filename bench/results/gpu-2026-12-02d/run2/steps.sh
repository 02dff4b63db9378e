source bench/device/setup.sh
cd $PWD
echo "== tests" >> $OUT/log.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_fp8.py tests/test_kernel_moe_gemm.py -k "cuda" >> $OUT/log.txt 2>&1
echo "== probe fp8" >> $OUT/log.txt
timeout 330 python3 -m bench.probe_moe --fp8 --tokens 64 16 1 --stages 3 4 --iters 30 --json $OUT/probe_fp8.jsonl > $OUT/probe_fp8.txt 2>&1
tail -5 $OUT/probe_fp8.txt >> $OUT/log.txt
grep -E "built-in|best" $OUT/probe_fp8.txt >> $OUT/log.txt
