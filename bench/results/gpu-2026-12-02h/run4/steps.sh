source bench/device/setup.sh
export TRITON_CACHE_DIR=/tmp/tcache
timeout 150 python3 -m pytest -q tests/test_checkpoint_fp8.py tests/test_moe_fp8.py -k "gpu or cuda" > $OUT/t_gpu.log 2>&1; echo "rc $?" >> $OUT/t_gpu.log
P="python3 -m bench.probe_moe --fp8 --act-fp8 --built-in-only --iters 20"
timeout 90 $P --tokens 128 256 384 > $OUT/probe_bench.txt 2>&1; echo "rc $?" >> $OUT/probe_bench.txt
timeout 60 $P --model dsv3 --tokens 64 > $OUT/probe_dsv3.txt 2>&1; echo "rc $?" >> $OUT/probe_dsv3.txt
timeout 150 python3 -m bench.forward --batch 256 --contexts 8192 --iters 10 --expert-dtype fp8_w8a16 fp8_e4m3 > $OUT/fwd_b256.txt 2>&1; echo "rc $?" >> $OUT/fwd_b256.txt
echo done > $OUT/done.txt
