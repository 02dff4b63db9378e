"""Launch configurations measured per GPU model, the way vLLM and SGLang ship tuned MoE configs.

`python -m bench.tune_kernels` times every candidate configuration of a kernel on the GPU it
runs on and writes wideep_kernels/tuned/<gpu name>.json: {kernel: {shape key: config}}. The kernels
look their shape up there and keep their built-in choice when the entry is missing.

A GPU without a table of its own takes the table of a tuned GPU of the same compute capability,
the first by name (an H800 or a GH200 takes the H100's): what those tables mostly choose is which
kernel form runs (on Hopper, the wgmma form of the MLA split kernel, 2x the built-in choice at a
256-row step), which depends on the architecture, not on the part. WIDEEP_TUNED_TABLE names the table to use
instead (a file stem such as NVIDIA_H200), or `none` for the built-in choices.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

from . import log

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


def capability_key(device: torch.device) -> str:
    """A table's `capability` field, e.g. '9.0'."""
    return "%d.%d" % torch.cuda.get_device_capability(device)


@functools.cache
def _capability(index: int) -> str:
    return capability_key(torch.device("cuda", index))


@functools.cache
def table_for(index: int) -> tuple[str | None, dict]:
    """(stem, table) a GPU's kernels use: WIDEEP_TUNED_TABLE's, else its own, else the first (by
    name) of its compute capability, else none."""
    chosen = os.environ.get("WIDEEP_TUNED_TABLE", "").strip()
    if chosen:
        if chosen.lower() == "none":
            return None, {}
        table = _table(chosen)
        if not table:
            raise ValueError(f"WIDEEP_TUNED_TABLE={chosen!r}: no table {TUNED_DIR / (chosen + '.json')}")
        return chosen, table
    own = _stem(index)
    if _table(own):
        log.info("tuned launch table: %s", own)
        return own, _table(own)
    capability = _capability(index)
    for path in sorted(TUNED_DIR.glob("*.json")):
        if _table(path.stem).get("capability") == capability:
            log.info("no tuned launch table for %s: using %s's (compute capability %s)", own, path.stem, capability)
            return path.stem, _table(path.stem)
    # The built-in choices cost an H100 18% of a batch-1 decode step and 27% of a 32K prefill
    # against its table (RESULTS, forty-second session): worth saying once.
    log.warning("no tuned launch table for %s (compute capability %s): built-in kernel launch choices; "
                "`python -m bench.tune_kernels` on this GPU writes one", own, capability)
    return None, {}


def batch_bucket(b: int) -> int:
    """The tuned batch size a batch of b sequences uses (the smallest bucket >= b)."""
    return next((x for x in BATCH_BUCKETS if x >= b), BATCH_BUCKETS[-1])


def table_name(device: torch.device) -> str | None:
    """The stem of the table a device's kernels use (None: the built-in choices), for benchmark rows."""
    if device.type != "cuda":
        return None
    return table_for(device.index if device.index is not None else torch.cuda.current_device())[0]


def tuned_config(device: torch.device, kernel: str, key: str) -> dict | None:
    if device.type != "cuda":
        return None
    _, table = table_for(device.index if device.index is not None else torch.cuda.current_device())
    return table.get(kernel, {}).get(key)


def reload() -> None:
    """Forget the cached tables (after the tuner wrote a new one)."""
    _table.cache_clear()
    table_for.cache_clear()
