#!/usr/bin/env bash
# GPU run 1 (one H200 is enough): kernels and the decode path on the GPU, then the
# kernel benchmarks, each side by side with its reference. Logs and JSON go to $OUT.
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
t 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_routing.py tests/test_kernel_indexer.py \
  tests/test_kernel_mla_decode.py tests/test_kernel_moe_gemm.py tests/test_kernel_norm_rope.py \
  tests/test_kernel_swiglu_latent.py tests/test_decode_path.py -k "cuda or gpu" \
  > "$OUT/gpu_tests.log" 2>&1
for k in routing indexer mla_decode moe_gemm norm_rope; do
  t 75 python3 -m bench.kernel_$k --device cuda --json "$OUT/kernel_$k.json" > "$OUT/kernel_$k.log" 2>&1
done
cat "$OUT/steps.txt"; tail -3 "$OUT/gpu_tests.log"
