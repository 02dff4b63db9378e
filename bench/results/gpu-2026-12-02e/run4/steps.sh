source bench/device/setup.sh
L=$OUT/log.txt
echo "== w8a8 gpu tests" >> $L
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_w8a8.py -k "cuda" >> $L 2>&1
echo "== probe bench built-in (bf16 / w8a16 / w8a8)" >> $L
timeout 60 python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --tokens 16 64 128 512 2048 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_builtin.txt >> $L
echo "== probe dsv3 built-in" >> $L
timeout 45 python3 -m bench.probe_moe --fp8 --act-fp8 --model dsv3 --built-in-only --tokens 16 64 128 --iters 20 > $OUT/probe_dsv3.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_dsv3.txt >> $L
echo "== forward" >> $L
timeout 90 python3 -m bench.forward --batch 64 --contexts 8192 --iters 10 --expert-dtype fp8_e4m3 fp8_w8a8 --json $OUT/fwd.jsonl >> $L 2>&1
echo done >> $L
