source bench/device/setup.sh
timeout 270 python3 -m bench.probe_moe --tokens 256 --block-m 16 32 --stages 3 4 --iters 30 > $OUT/moe256.log 2>&1
grep built_in_us $OUT/moe256.log
