#!/usr/bin/env bash
# FlashInfer's MLA decode against ours on the same top-k keys, alone and with the window ring
# as the decode step reads it (bench.flashinfer_mla --window). Carry the
# wheel from bench/device/pack_flashinfer.sh (.devpack/flashinfer_python-0.2.14-py3-none-any.whl)
# and .devpack/pydantic-site.tgz (bench/device/pack_pydantic.sh), not the Ray bundle: no Ray
# is needed, and with the bundle the tree would pass 64 MiB. FlashInfer builds its
# kernels with nvcc on first use: minutes, once per machine. BENCH=sampling instead times
# FlashInfer's top-k / top-p cuts against the sampler's (bench.sampling --flashinfer).
source bench/device/setup.sh
t() { local s=$1; shift; local t0=$SECONDS; timeout "$s" "$@"; echo "rc=$? $((SECONDS - t0))s $*" >> "$OUT/steps.txt"; }
python3 -m pip install -q --no-deps --no-compile --target /tmp/fisite .devpack/flashinfer_python-*.whl \
  > "$OUT/flashinfer_install.log" 2>&1
export PYTHONPATH=/tmp/fisite:$PYTHONPATH TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
if [ "${BENCH:-mla}" = sampling ]; then
  t ${FLASHINFER_TIMEOUT:-480} python3 -m bench.sampling --device cuda --batches 1 16 64 --vocab 129280 \
    --kinds temperature top_p=0.9 top_k+top_p --flashinfer --json "$OUT/fi_sampling.jsonl" > "$OUT/fi_sampling.log" 2>&1
  cat "$OUT/fi_sampling.log"
else
  t ${FLASHINFER_TIMEOUT:-480} python3 -m bench.flashinfer_mla --batches 1 4 16 32 64 128 --backends ${BACKENDS:-fa2 fa3} \
    --window ${WINDOW:-128} --json "$OUT/flashinfer.jsonl" > "$OUT/flashinfer.log" 2>&1
fi
