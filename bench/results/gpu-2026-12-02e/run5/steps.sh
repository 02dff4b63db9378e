source bench/device/setup.sh
L=$OUT/log.txt
timeout 50 python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --tokens 2048 1024 --iters 20 > $OUT/probe_builtin.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_builtin.txt >> $L
timeout 40 python3 -m bench.probe_moe --fp8 --act-fp8 --model dsv3 --built-in-only --tokens 128 --iters 20 > $OUT/probe_dsv3.txt 2>&1
grep -E 'sweep|rror' $OUT/probe_dsv3.txt >> $L
