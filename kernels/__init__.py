"""Triton kernels, each beside a plain-torch reference that defines its exact semantics.

This package must not import ray or engine: the engine imports kernels, never the other way.
"""
import os

import torch


def triton_ok(t: torch.Tensor) -> bool:
    """True when a Triton kernel can run on `t`: natively on CUDA, or on CPU under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return bool(t.is_cuda) or os.environ.get("TRITON_INTERPRET") == "1"
