source bench/device/setup.sh; timeout 150 python3 -m pytest -q -x tests/test_kernel_moe_fp8.py tests/test_kernel_moe_w8a8.py -k "cuda and chunk"
