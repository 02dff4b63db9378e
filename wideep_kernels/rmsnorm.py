"""RMSNorm in one kernel launch.

The torch expression (engine/layers.py RMSNorm.forward) is half a dozen launches per norm
(cast, square, mean, add, rsqrt, mul, cast back, weight mul) and a decode step runs three or
four norms per layer: at decode batch sizes those launches, not the bytes, set the time.

`rms_norm_reference` defines the semantics; `rms_norm_triton` matches it to float32 rounding
(bf16/fp16 outputs within one unit in the last place; usually equal); `rms_norm` picks one.
`add_rms_norm` folds the residual add before a norm into the same launch (h = x + residual,
then the norm of h; both returned), as the decoder layers do twice per layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # the reference path must keep working where triton is absent
    triton = None

# Rows wider than this are normalised in chunks (two passes over the row) rather than held in registers.
MAX_BLOCK_D = 8192
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Exactly engine/layers.py RMSNorm.forward (kernels must not import engine)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) for h = x + residual in x's dtype; an fp32 x with a 16-bit residual (an
    unrounded sum, e.g. the routed experts') is rounded to the residual's dtype first."""
    if x.dtype != residual.dtype and x.dtype == torch.float32:
        x = x.to(residual.dtype)
    h = x + residual
    return rms_norm_reference(h, weight, eps), h


if triton is not None:
    @triton.jit
    def cast_rne(v, DTYPE: tl.constexpr):
        """fp32 -> DTYPE, rounding to nearest even as torch does. The interpreter truncates
        fp32 -> bf16 casts, so bf16 is rounded by hand (same bits as the GPU's cvt.rn)."""
        if DTYPE == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            b = tl.where(v != v, 0x7FC0, u >> 16).to(tl.uint16)  # NaN stays NaN, not inf
            return b.to(tl.bfloat16, bitcast=True)
        else:
            return v.to(DTYPE)

    @triton.jit
    def _rstd(sum_sq, D, eps):
        # Correctly rounded divide and sqrt (once a row, so free): the GPU's default approximate
        # ones would add an ulp or two that neither torch's CPU path nor the interpreter has.
        return tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, D * 1.0) + eps))

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, h_ptr, D, stride_x, stride_r, eps,
                         BLOCK_D: tl.constexpr, NUM_CHUNKS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        out_row = out_ptr + row * D
        # x's dtype, or with a residual h's: an fp32 x (an unrounded sum) is rounded to it first
        X_DTYPE: tl.constexpr = h_ptr.dtype.element_ty
        OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK_D)
        if NUM_CHUNKS == 1:
            ok = cols < D
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                if x_ptr.dtype.element_ty != X_DTYPE:
                    x = cast_rne(x, X_DTYPE).to(tl.float32)
                # h = x + residual rounded to x's dtype, as torch's add; the norm reads h.
                r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
                h = cast_rne(x + r, X_DTYPE)
                tl.store(h_ptr + row * D + cols, h, mask=ok)
                x = h.to(tl.float32)
            rstd = _rstd(tl.sum(x * x, axis=0), D, eps)
            # The normalised row is rounded to x's dtype before the weight multiply, as the
            # reference's `.to(x.dtype)` does; the multiply then runs in fp32 and rounds once.
            y = cast_rne(x * rstd, X_DTYPE).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_row + cols, cast_rne(w * y, OUT_DTYPE), mask=ok)
        else:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for c in tl.static_range(NUM_CHUNKS):
                offs = c * BLOCK_D + cols
                x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(tl.float32)
                acc += x * x
            rstd = _rstd(tl.sum(acc, axis=0), D, eps)
            for c in tl.static_range(NUM_CHUNKS):
                offs = c * BLOCK_D + cols
                ok = offs < D
                x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
                y = cast_rne(x * rstd, X_DTYPE).to(tl.float32)
                w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
                tl.store(out_row + offs, cast_rne(w * y, OUT_DTYPE), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _num_warps(block_d: int) -> int:
    """About 16 fp32 elements a thread (512 a warp), 1 to 8 warps. Not tuned on a GPU yet:
    the kernel is launch-bound at decode sizes, so the choice matters little there."""
    return max(1, min(8, block_d // 512))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    block_d: int | None = None) -> torch.Tensor:
    """The Triton kernel; see `rms_norm` for the contract. `block_d` (a power of two) overrides the
    chunk width (tests use it to reach the chunked path on small rows)."""
    if triton is None:
        raise RuntimeError("triton is not available")
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"weight must be [{d}], got {tuple(weight.shape)}")
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes float32/bfloat16/float16, got x {x.dtype}, weight {weight.dtype}")
    # The product's dtype is torch's promotion of the two, as in the reference (fp32 weight on bf16 x: fp32).
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, d)  # a view where the leading dims collapse to one stride (slices of a wider row do)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    block = block_d or min(_pow2(d), MAX_BLOCK_D)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight.contiguous(), out, rows, rows, d, rows.stride(0), 0, float(eps),
        BLOCK_D=block, NUM_CHUNKS=triton.cdiv(d, block), HAS_RESIDUAL=False, num_warps=_num_warps(block),
        enable_fp_fusion=False,  # the rounding the interpreter (and so the CPU tests) sees
        **pdl_launch(rows))
    return out


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel for rows of at most MAX_BLOCK_D; see `add_rms_norm`."""
    if triton is None:
        raise RuntimeError("triton is not available")
    d = x.shape[-1]
    if residual.shape != x.shape or not _residual_dtype_ok(x, residual):
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
    if weight.shape != (d,) or d > MAX_BLOCK_D:
        raise ValueError(f"weight must be [{d}] and rows at most {MAX_BLOCK_D} wide")
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes float32/bfloat16/float16, got x {x.dtype}, weight {weight.dtype}")
    out = torch.empty(x.shape, dtype=torch.promote_types(residual.dtype, weight.dtype), device=x.device)
    h = torch.empty_like(residual)
    if out.numel() == 0:
        return out, h
    rows, res = x.reshape(-1, d), residual.reshape(-1, d)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    res = res if res.stride(-1) == 1 else res.contiguous()
    block = _pow2(d)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, weight.contiguous(), out, res, h, d, rows.stride(0), res.stride(0), float(eps),
        BLOCK_D=block, NUM_CHUNKS=1, HAS_RESIDUAL=True, num_warps=_num_warps(block),
        enable_fp_fusion=False, **pdl_launch(rows))
    return out, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm_fp32(x).to(x.dtype) over the last dim of x [..., D]; weight [D].

    The norm is computed in fp32 (mean of squares, rsqrt(mean + eps)) and rounded to x's dtype;
    the weight product has torch's promoted dtype of x and weight (bf16 x, bf16 weight: bf16).
    Triton on CUDA tensors (on CPU only under TRITON_INTERPRET=1 and WIDEEP_CPU_KERNELS=1) for
    float32/bfloat16/float16 without autograd, the torch reference otherwise.
    """
    use_kernel = (triton is not None and triton_ok(x) and x.dtype in _KERNEL_DTYPES
                  and weight.dtype in _KERNEL_DTYPES
                  and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if not use_kernel:
        return rms_norm_reference(x, weight, eps)
    return kernel_or_reference("rms_norm", rms_norm_triton, rms_norm_reference, x, weight, eps)


def _residual_dtype_ok(x: torch.Tensor, residual: torch.Tensor) -> bool:
    return residual.dtype == x.dtype or (x.dtype == torch.float32 and residual.dtype in (torch.bfloat16,
                                                                                        torch.float16))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h, weight, eps), h) for h = x + residual (same shape and dtype, added in that
    dtype as torch does): the residual stream's add and the next norm in one launch. x may also
    be an fp32 sum on a 16-bit residual: it is rounded to the residual's dtype first, in the same
    launch (so the routed experts need no cast of their own). Same dispatch as `rms_norm`; rows
    wider than MAX_BLOCK_D take the reference."""
    use_kernel = (triton is not None and triton_ok(x) and x.dtype in _KERNEL_DTYPES
                  and weight.dtype in _KERNEL_DTYPES and _residual_dtype_ok(x, residual)
                  and residual.shape == x.shape and x.shape[-1] <= MAX_BLOCK_D
                  and not (torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                                        or weight.requires_grad)))
    if not use_kernel:
        return add_rms_norm_reference(x, residual, weight, eps)
    return kernel_or_reference("add_rms_norm", add_rms_norm_triton, add_rms_norm_reference,
                               x, residual, weight, eps)
