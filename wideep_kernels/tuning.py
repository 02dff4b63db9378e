"""Launch configurations measured per GPU model, the way vLLM and SGLang ship tuned MoE configs.

`python -m bench.tune_kernels` times every candidate configuration of a kernel on the GPU it
runs on and writes wideep_kernels/tuned/<gpu name>.json: {kernel: {shape key: config}}. The kernels
look their shape up there and keep their built-in choice when the file or the entry is missing,
so an untuned GPU runs exactly as before.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

TUNED_DIR = Path(__file__).parent / "tuned"
BATCH_BUCKETS = (1, 4, 16, 64, 256)


def gpu_key(device: torch.device) -> str:
    """File stem of a GPU model's table, e.g. 'NVIDIA_H200'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


@functools.cache
def _table(stem: str) -> dict:
    path = TUNED_DIR / f"{stem}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def _stem(index: int) -> str:
    return gpu_key(torch.device("cuda", index))


def batch_bucket(b: int) -> int:
    """The tuned batch size a batch of b sequences uses (the smallest bucket >= b)."""
    return next((x for x in BATCH_BUCKETS if x >= b), BATCH_BUCKETS[-1])


def tuned_config(device: torch.device, kernel: str, key: str) -> dict | None:
    if device.type != "cuda":
        return None
    return _table(_stem(device.index if device.index is not None else torch.cuda.current_device())).get(
        kernel, {}).get(key)


def reload() -> None:
    """Forget the cached tables (after the tuner wrote a new one)."""
    _table.cache_clear()
