#!/usr/bin/env bash
# Builds .devpack/pydantic-site.tgz: pydantic and its few dependencies, and xgrammar, unpacked for
# the GPU machine's Python 3.12, about 6 MB. The engine's config needs pydantic, which the GPU image
# lacks; runs without Ray (kernels, forward, FlashInfer) carry this instead of the 57 MB Ray
# bundle, which with the FlashInfer wheel would pass the 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .devpack
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$tmp/wheels" pydantic
# structured output's grammars (engine/structured.py); torch, triton and transformers come from the image
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp/wheels" "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
mkdir "$tmp/site"
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
tar czf .devpack/pydantic-site.tgz -C "$tmp/site" .
ls -la .devpack/pydantic-site.tgz
