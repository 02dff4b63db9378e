source bench/device/setup.sh; export TRITON_CACHE_DIR=/tmp/tcache
timeout 200 python3 -m pytest -q tests/test_kernel_moe_fp8.py -k "cuda and chunk" > $OUT/t_kfp8.log 2>&1; echo "rc $?" >> $OUT/t_kfp8.log
timeout 150 python3 -m pytest -q tests/test_decode_path.py -k "cuda or gpu" > $OUT/t_decode.log 2>&1; echo "rc $?" >> $OUT/t_decode.log
