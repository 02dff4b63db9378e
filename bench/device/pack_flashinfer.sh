#!/usr/bin/env bash
# Builds .devpack/flashinfer_python-<version>-py3-none-any.whl for bench/device/flashinfer.sh:
# about 5 MB of Python, kernel sources and CUTLASS headers; FlashInfer compiles the kernels with
# the GPU machine's nvcc on first use. 0.2.14 needs nothing that machine lacks (later releases
# need apache-tvm-ffi, nvidia-cutlass-dsl and more, and their wheel is over 100 MB).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devpack
python3 -m pip wheel -q --no-deps "flashinfer-python==${FLASHINFER_VERSION:-0.2.14}" -w .devpack
ls -la .devpack/flashinfer_python-*.whl
