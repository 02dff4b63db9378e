"""Rotary position embedding in one kernel launch.

The torch expression (engine/layers.py Rotary.apply) is about ten launches per call (views,
fp32 cast, two strided splits, four multiplies, add/sub, cat, cast back), twice per layer (q
and k); here one program rotates every head of one token, reading x in place through its
strides (the rope slice of q [T, H, nope + rope] needs no copy).

`apply_rope_reference` defines the semantics; `apply_rope_triton` matches it bit for bit
(each product and sum rounded to fp32 separately, as eager torch does: FMA contraction is
off; checked under the interpreter, not yet on a GPU); `apply_rope` picks one.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .rmsnorm import cast_rne
except Exception:  # the reference path must keep working where triton is absent
    triton = None

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Heads rotated by one program: enough that a decode token ([16, 64]) is one program.
MAX_BLOCK_ELEMS = 4096


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Exactly engine/layers.py Rotary.apply (kernels must not import engine)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    cos, sin = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


if triton is not None:
    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ct, stride_st,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     INTERLEAVE: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_HALF)
        i_ok = i < HALF
        c = tl.load(cos_ptr + tok * stride_ct + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + tok * stride_st + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        ok = (heads < H)[:, None] & i_ok[None, :]
        x_row = x_ptr + tok * stride_xt + heads.to(tl.int64)[:, None] * stride_xh
        if INTERLEAVE:
            x1 = tl.load(x_row + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + 2 * i[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(x_row + i[None, :], mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(x_row + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
        # Halves out in both layouts, as the reference's cat does.
        out_row = out_ptr + (tok * H + heads.to(tl.int64))[:, None] * (2 * HALF)
        OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(out_row + i[None, :], cast_rne(x1 * c - x2 * s, OUT_DTYPE), mask=ok)
        tl.store(out_row + HALF + i[None, :], cast_rne(x2 * c + x1 * s, OUT_DTYPE), mask=ok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                      block_h: int | None = None) -> torch.Tensor:
    """The Triton kernel; see `apply_rope` for the contract. `block_h` (a power of two) overrides
    the heads per program (tests use it to split a token's heads over programs)."""
    if triton is None:
        raise RuntimeError("triton is not available")
    if x.dim() < 2:
        raise ValueError("x must be [T, ..., dim]")
    t, dim = x.shape[0], x.shape[-1]
    if dim % 2:
        raise ValueError(f"the rotary dim must be even, got {dim}")
    half = dim // 2
    if cos.shape != (t, half) or sin.shape != (t, half):
        raise ValueError(f"cos and sin must be [{t}, {half}], got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel takes float32/bfloat16/float16, got {x.dtype}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError("cos and sin must be float32 (other dtypes change the reference's compute dtype)")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    # One head axis with one stride: a view for slices of a wider last dim, a copy only for
    # layouts whose middle dims do not collapse.
    xv = x.reshape(t, -1, dim)
    if xv.stride(-1) != 1:
        xv = xv.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    h = xv.shape[1]
    block_half = _pow2(half)
    block_h = block_h or min(_pow2(h), max(1, MAX_BLOCK_ELEMS // (2 * block_half)))
    elems = block_h * 2 * block_half
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        xv, cos, sin, out, h, xv.stride(0), xv.stride(1), cos.stride(0), sin.stride(0),
        HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, INTERLEAVE=bool(interleave),
        num_warps=max(1, min(4, elems // 1024)), enable_fp_fusion=False, **pdl_launch(xv))
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate x [T, ..., dim] by the fp32 tables cos, sin [T, dim/2]; same shape and dtype, contiguous.

    In fp32: (x1, x2) are the pairs (x0, x1), (x2, x3)... when `interleave`, else the two halves;
    out = cat([x1*cos - x2*sin, x2*cos + x1*sin], -1).to(x.dtype) (halves out in both layouts).
    x may be a strided view (token and head strides; last dim contiguous).
    Triton on CUDA tensors (on CPU only under TRITON_INTERPRET=1 and WIDEEP_CPU_KERNELS=1) for
    float32/bfloat16/float16 without autograd, the torch reference otherwise.
    """
    use_kernel = (triton is not None and triton_ok(x) and x.dtype in _KERNEL_DTYPES
                  and cos.dtype == sin.dtype == torch.float32 and not (torch.is_grad_enabled() and x.requires_grad))
    if not use_kernel:
        return apply_rope_reference(x, cos, sin, interleave)
    return kernel_or_reference("apply_rope", apply_rope_triton, apply_rope_reference, x, cos, sin, interleave)
