"""Programmatic dependent launch (Hopper and later): the decode step's kernels overlap their
start with the end of the kernel before them.

A kernel launched this way may be scheduled before the kernel ahead of it in the stream has
finished. Its first instruction (`pdl_enter`) waits until that kernel has completed and its
writes are visible, so nothing it reads or writes can race; what overlaps is the launch, the
programs' placement and their setup, which at batch 1 is most of a small kernel's time. With
`WIDEEP_PDL=early` each kernel also lets the next one be scheduled as soon as all of its own
programs have started, so the next one's programs wait on the multiprocessors instead of in the
launch queue. Kernels that are not ours (cuBLAS, torch) are launched as usual, and the kernel
after one of them simply waits for it to finish, as without this.

    WIDEEP_PDL=off | wait | early    (default: early; read once, at import)

On the H200 the decode step at an 8K context took, off / wait / early: 1.60 / 1.58 / 1.49 ms at
batch 1, 2.90 / - / 2.79 at 16, 4.35 / 4.31 / 4.28 at 64 (bench.forward; RESULTS, twelfth session).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton before 3.3, or none: every launch is a plain one
    gdc_wait = None

MODES = {"off": 0, "wait": 1, "early": 2}
_mode_name = os.environ.get("WIDEEP_PDL", "early").strip().lower()
if _mode_name not in MODES:
    raise ValueError(f"WIDEEP_PDL must be one of {sorted(MODES)}, got {_mode_name!r}")
MODE = MODES[_mode_name]


@functools.cache
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9 and os.environ.get("TRITON_INTERPRET") != "1"


def pdl_mode(t: torch.Tensor) -> int:
    """The mode for a launch on `t`'s device: 0 off the GPU, before sm_90, or without Triton's
    grid-dependency calls."""
    if MODE == 0 or gdc_wait is None or not t.is_cuda:
        return 0
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return MODE if _hopper_or_later(index) else 0


def pdl_launch(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch on `t`'s device: the kernel's PDL constexpr and Triton's
    launch option, or nothing (the kernels' PDL defaults to 0)."""
    mode = pdl_mode(t)
    return {"PDL": mode, "launch_pdl": True} if mode else {}


if gdc_wait is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        # Must run before the kernel's first global load or store.
        if PDL >= 1:
            gdc_wait()
        if PDL >= 2:
            gdc_launch_dependents()
elif triton is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        pass
