"""SwiGLU's activation, silu(gate) * up, in one kernel launch.

The MLPs (dense layers, shared experts) compute gate and up in one GEMM, [T, 2I]; torch then
launches silu and a multiply, each over [T, I] with its own read and write. At decode sizes the
launches, not the bytes, set the time; one kernel reads the pair and writes the product.

`silu_mul_reference` defines the semantics; `silu_mul_triton` rounds as it does (silu rounded to
the input dtype, then the product); `silu_mul` picks one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from triton.language.extra import libdevice
    from .rmsnorm import cast_rne
except Exception:  # the reference path must keep working where triton is absent
    triton = None

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_COLS = 1024


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = cat([gate, up], -1); [..., I] in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_row, BLOCK: tl.constexpr, CUDA_EXP: tl.constexpr,
                         PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * stride_row + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_row + inter + cols, mask=ok, other=0.0).to(tl.float32)
        # torch rounds silu's result to the input dtype before the multiply; so do we. On CUDA,
        # libdevice's exp is the expf of torch's silu: tl.exp (ex2.approx) moved an fp16 product
        # by 2 ulp on the H200 where a rounding boundary fell between the two. (The interpreter
        # has no libdevice; its tl.exp is numpy's.)
        if CUDA_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = cast_rne(tl.div_rn(g, 1.0 + e), DTYPE).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, cast_rne(s * u, DTYPE), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel; see `silu_mul` for the contract."""
    if triton is None:
        raise RuntimeError("triton is not available")
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"the last dim holds gate and up and must be even, got {two_i}")
    if gate_up.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes float32/bfloat16/float16, got {gate_up.dtype}")
    inter = two_i // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    rows = gate_up.reshape(-1, two_i)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = min(BLOCK_COLS, triton.next_power_of_2(inter))
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, inter, rows.stride(0), BLOCK=block, CUDA_EXP=rows.is_cuda, num_warps=4,
        enable_fp_fusion=False,  # the rounding the interpreter (and so the CPU tests) sees
        **pdl_launch(rows))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] holding gate then up; returns [..., I], contiguous,
    in gate_up's dtype (silu rounded to that dtype before the multiply, as torch does).
    Triton on CUDA tensors (on CPU only under TRITON_INTERPRET=1 and WIDEEP_CPU_KERNELS=1) for
    float32/bfloat16/float16 without autograd, the torch reference otherwise."""
    use_kernel = (triton is not None and triton_ok(gate_up) and gate_up.dtype in _KERNEL_DTYPES
                  and gate_up.shape[-1] % 2 == 0 and not (torch.is_grad_enabled() and gate_up.requires_grad))
    if not use_kernel:
        return silu_mul_reference(gate_up)
    return kernel_or_reference("silu_mul", silu_mul_triton, silu_mul_reference, gate_up)


__all__ = ["silu_mul", "silu_mul_reference", "silu_mul_triton"]
