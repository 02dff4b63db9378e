source bench/device/setup.sh
L=$OUT/log.txt
echo "== fp8 kernel/engine gpu tests" >> $L
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_fp8.py tests/test_moe_fp8.py -k "cuda or gpu" >> $L 2>&1
echo "== chunk + decode built-in" >> $L
timeout 90 python3 -m bench.probe_moe --fp8 --built-in-only --tokens 512 2048 64 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'built-in|Warn|warn|rror' $OUT/probe_builtin.txt >> $L
echo "== forward b64 fp8 profile" >> $L
timeout 110 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 --expert-dtype fp8_e4m3 --profile $OUT/profile64.txt --json $OUT/fwd.jsonl >> $L 2>&1
echo "== dsv3 decode sweep" >> $L
timeout 120 python3 -m bench.probe_moe --fp8 --model dsv3 --tokens 64 16 128 --stages 3 --iters 20 > $OUT/probe_dsv3.txt 2>&1
grep -E 'bf16 built-in|best' $OUT/probe_dsv3.txt >> $L
echo "== chunk fp8 sweep 2048" >> $L
timeout 90 python3 -m bench.probe_moe --fp8 --prefill --tokens 2048 --stages 3 --iters 10 > $OUT/probe_prefill.txt 2>&1
grep -E 'bf16 built-in|best' $OUT/probe_prefill.txt >> $L
echo done >> $L
