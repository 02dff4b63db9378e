source bench/device/setup.sh
L=$OUT/log.txt
echo "== gpu tests" >> $L
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_moe_fp8.py -k "cuda" >> $L 2>&1
echo "== kernels, built-in shapes" >> $L
timeout 80 python3 -m bench.probe_moe --fp8 --built-in-only --tokens 512 2048 64 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'built-in' $OUT/probe_builtin.txt >> $L
tail -3 $OUT/probe_builtin.txt >> $L
