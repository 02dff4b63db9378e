"""Triton kernels, each beside a plain-torch reference that defines its exact semantics.

This package must not import ray or engine: the engine imports kernels, never the other way.
"""
import os

import torch


def triton_ok(t: torch.Tensor) -> bool:
    """True when the dispatchers should run a Triton kernel on `t`: natively on CUDA; on CPU only
    under TRITON_INTERPRET=1 *and* WIDEEP_CPU_KERNELS=1. The interpreter is far slower than the
    torch references, so tests that interpret kernels (TRITON_INTERPRET must be set before triton
    is first imported, i.e. for the whole test process) still run the engine on the references."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("WIDEEP_CPU_KERNELS") == "1"
