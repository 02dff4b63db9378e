"""Triton kernels, each beside a plain-torch reference that defines its exact semantics.

This package must not import ray or engine: the engine imports kernels, never the other way.
"""
import logging
import os

import torch

log = logging.getLogger(__name__)
_unusable: set[str] = set()


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


def kernel_or_reference(name: str, kernel, reference, *args):
    """kernel(*args), unless it cannot be built or launched here (a Triton release or GPU it was
    not checked on): then warn once and use the reference from then on (reference None: return
    None, for a caller with a path of its own). Argument errors (ValueError, TypeError) are the
    caller's and still raise; wrong results are the tests' job."""
    if name not in _unusable:
        try:
            return kernel(*args)
        except (ValueError, TypeError):
            raise
        except Exception as e:
            _unusable.add(name)
            log.warning("Triton kernel %s failed here (%s: %s); using %s from now on", name, type(e).__name__, e,
                        "the caller's torch path" if reference is None else "its torch reference")
    return None if reference is None else reference(*args)
