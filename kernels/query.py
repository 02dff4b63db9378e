"""The absorbed attention query in one launch: q_nope @ W_UK into the latent space, and the rope
part rotated.

MLA attends in the latent space: each head's no-rope query part is mapped through that head's
slice of kv_b_proj (W_UK), and its rope part is rotated by the token's position. In torch these
are a batched GEMM and the rope kernel, two dependent launches a layer whose time at decode is
their ramp, not their bytes (W_UK is 2 MB in the bench model). Here the programs of one launch
share them: per head, column blocks of the GEMM, and one program more that rotates the rope part.

`absorb_query_reference` defines the semantics (the torch expressions the model used);
`absorb_query_triton` matches it to the rounding of the GEMM's sum; `absorb_query` picks one.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok
from .rope import apply_rope

try:
    import triton
    import triton.language as tl
    from .rmsnorm import cast_rne
except Exception:  # the reference path must keep working where triton is absent
    triton = None

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_T = 64  # tokens a program: a decode batch up to 64 in one row of programs
BLOCK_C = 64  # latent columns a program


def absorb_query_reference(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, nope + rope], w_uk [H, nope, C] -> (q_nope @ w_uk per head [T, H, C], the rope
    part rotated as kernels/rope.py does [T, H, rope]), both in q's dtype."""
    nope = w_uk.shape[1]
    q_nope, q_rope = q.split([nope, q.shape[-1] - nope], dim=-1)
    return torch.einsum("thd,hdc->thc", q_nope, w_uk), apply_rope(q_rope, cos, sin, interleave)


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _absorb_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, lat_ptr, rope_ptr, T, H,
                       stride_qt, stride_qh, stride_wh, stride_wd, stride_ct, stride_st,
                       NOPE: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_C: tl.constexpr, INTERLEAVE: tl.constexpr, PRECISION: tl.constexpr,
                       DOT_FP32: tl.constexpr):
        head = tl.program_id(0)
        col_block = tl.program_id(1)
        toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = toks < T
        q_rows = q_ptr + toks.to(tl.int64)[:, None] * stride_qt + head * stride_qh
        out_rows = (toks.to(tl.int64) * H + head)[:, None]
        if col_block == tl.num_programs(1) - 1:  # the rope part, as kernels/rope.py rotates it
            i = tl.arange(0, BLOCK_HALF)
            ok = t_ok[:, None] & (i < HALF)[None, :]
            c = tl.load(cos_ptr + toks[:, None] * stride_ct + i[None, :], mask=ok, other=0.0)
            s = tl.load(sin_ptr + toks[:, None] * stride_st + i[None, :], mask=ok, other=0.0)
            if INTERLEAVE:
                x1 = tl.load(q_rows + NOPE + 2 * i[None, :], mask=ok, other=0.0).to(tl.float32)
                x2 = tl.load(q_rows + NOPE + 2 * i[None, :] + 1, mask=ok, other=0.0).to(tl.float32)
            else:
                x1 = tl.load(q_rows + NOPE + i[None, :], mask=ok, other=0.0).to(tl.float32)
                x2 = tl.load(q_rows + NOPE + HALF + i[None, :], mask=ok, other=0.0).to(tl.float32)
            out = rope_ptr + out_rows * (2 * HALF) + i[None, :]
            OUT_DTYPE: tl.constexpr = rope_ptr.dtype.element_ty
            tl.store(out, cast_rne(x1 * c - x2 * s, OUT_DTYPE), mask=ok)
            tl.store(out + HALF, cast_rne(x2 * c + x1 * s, OUT_DTYPE), mask=ok)
        else:
            d = tl.arange(0, BLOCK_D)
            cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
            a = tl.load(q_rows + d[None, :], mask=t_ok[:, None] & (d < NOPE)[None, :], other=0.0)
            w = tl.load(w_ptr + head * stride_wh + d[:, None] * stride_wd + cols[None, :],
                        mask=(d < NOPE)[:, None] & (cols < C)[None, :], other=0.0)
            if DOT_FP32:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(a, w, input_precision=PRECISION)
            tl.store(lat_ptr + out_rows * C + cols[None, :], acc.to(lat_ptr.dtype.element_ty),
                     mask=t_ok[:, None] & (cols < C)[None, :])


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, (n - 1).bit_length()))


def absorb_query_triton(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel; see `absorb_query` for the contract."""
    if triton is None:
        raise RuntimeError("triton is not available")
    t, h, width = q.shape
    nope, c = w_uk.shape[1], w_uk.shape[2]
    half = (width - nope) // 2
    if w_uk.shape[0] != h or width - nope != 2 * half or half == 0:
        raise ValueError(f"q [T, {h}, nope + rope] and w_uk [{h}, nope, C] with an even rope part, "
                         f"got {tuple(q.shape)} and {tuple(w_uk.shape)}")
    if cos.shape != (t, half) or sin.shape != (t, half) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 [{t}, {half}]")
    if q.stride(-1) != 1 or w_uk.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("the last dims must be contiguous")
    lat = torch.empty(t, h, c, dtype=q.dtype, device=q.device)
    rope = torch.empty(t, h, 2 * half, dtype=q.dtype, device=q.device)
    if t == 0:
        return lat, rope
    # The interpreter multiplies bf16 bit patterns in tl.dot (see kernels/moe_gemm.py): on CPU the
    # operands go up to fp32, where their products are exact. fp32 operands get IEEE products.
    dot_fp32 = not q.is_cuda
    precision = "ieee" if dot_fp32 or q.dtype == torch.float32 else "tf32"
    grid = (h, triton.cdiv(c, BLOCK_C) + 1, triton.cdiv(t, BLOCK_T))
    _absorb_kernel[grid](
        q, w_uk, cos, sin, lat, rope, t, h, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1),
        cos.stride(0), sin.stride(0),
        NOPE=nope, C=c, HALF=half, BLOCK_D=_pow2(nope, 16), BLOCK_HALF=_pow2(half), BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C, INTERLEAVE=bool(interleave), PRECISION=precision, DOT_FP32=dot_fp32,
        num_warps=4, enable_fp_fusion=False,
    )
    return lat, rope


def absorb_query(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_lat, q_rope) of the absorbed query: q [T, H, nope + rope] (a view of the q_b
    projection is fine), w_uk [H, nope, C] (kv_b_proj's no-rope key rows, a strided view is fine),
    cos and sin fp32 [T, rope / 2] -> q_lat = einsum('thd,hdc->thc', q_nope, w_uk) [T, H, C] and
    q_rope rotated [T, H, rope] (kernels/rope.py's layout), both in q's dtype.
    One Triton launch on CUDA tensors (on CPU only under TRITON_INTERPRET=1 and
    WIDEEP_CPU_KERNELS=1) without autograd, the torch expressions otherwise."""
    use_kernel = (triton is not None and triton_ok(q) and q.dtype in _KERNEL_DTYPES and w_uk.dtype == q.dtype
                  and q.dim() == 3 and not torch.is_grad_enabled())
    if not use_kernel:
        return absorb_query_reference(q, w_uk, cos, sin, interleave)
    return kernel_or_reference("absorb_query", absorb_query_triton, absorb_query_reference, q, w_uk, cos, sin,
                               interleave)


__all__ = ["absorb_query", "absorb_query_reference", "absorb_query_triton"]
