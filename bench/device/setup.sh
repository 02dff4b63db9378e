# Sourced at the start of a run on a GPU machine without Ray or a package index: unpack the Ray
# Serve bundle (.devpack/ray-site.tar.xz, the wheels unpacked) and point Python at it and this checkout.
# A run that needs no Ray (kernels, forward, FlashInfer) may carry .devpack/pydantic-site.tgz
# (bench/device/pack_pydantic.sh) instead: the engine's config needs pydantic, the image lacks it.
mkdir -p /tmp/site
if [ -f .devpack/pydantic-site.tgz ] && [ ! -f .devpack/ray-site.tar.xz ]; then
  tar xzf .devpack/pydantic-site.tgz -C /tmp/site
fi
if [ -f .devpack/ray-site.tar.xz ]; then
  tar xJf .devpack/ray-site.tar.xz -C /tmp/site
  # the bundle's Ray binaries lose their exec bit in the archive
  find /tmp/site/ray/core -type f ! -name "*.py" ! -name "*.so*" -exec chmod +x {} +
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_TMPDIR=/tmp/ray
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
