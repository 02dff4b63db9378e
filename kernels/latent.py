"""A token's MLA latent in one kernel launch: the RMSNorm of its compressed KV and the rotary
embedding of its rope key, written side by side.

The attention layer's fused input GEMM yields [c_kv | k_rope] per token; the latent the caches
keep is [rms_norm(c_kv) | rope(k_rope)]. As torch (or as our norm and rope kernels, then a
concatenation) that is three launches a layer; here one program does one token.

`latent_reference` defines the semantics from the two references (kernels/rmsnorm.py,
kernels/rope.py); `latent_triton` rounds exactly as they do; `norm_rope_latent` picks one.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok
from .rmsnorm import rms_norm_reference
from .rope import apply_rope_reference

try:
    import triton
    import triton.language as tl
    from .rmsnorm import _rstd, cast_rne
except Exception:  # the reference path must keep working where triton is absent
    triton = None

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_KV_LORA = 8192  # the normalised part is held in registers whole


def latent_reference(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     interleave: bool) -> torch.Tensor:
    """cat([rms_norm(kv[:, :C]) * weight, rope(kv[:, C:])], -1) for kv [T, C + R], weight [C]."""
    c = weight.shape[0]
    c_kv, k_rope = kv[:, :c], kv[:, c:]
    return torch.cat([rms_norm_reference(c_kv, weight, eps), apply_rope_reference(k_rope, cos, sin, interleave)],
                     dim=-1)


if triton is not None:
    @triton.jit
    def _latent_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, C, stride_kv, stride_c, stride_s, eps,
                       HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       INTERLEAVE: tl.constexpr):
        tok = tl.program_id(0).to(tl.int64)
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        row = kv_ptr + tok * stride_kv
        out_row = out_ptr + tok * (C + 2 * HALF)
        # The norm, rounded as kernels/rmsnorm.py rounds it.
        cols = tl.arange(0, BLOCK_C)
        ok = cols < C
        x = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
        y = cast_rne(x * _rstd(tl.sum(x * x, axis=0), C, eps), DTYPE).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + cols, cast_rne(w * y, DTYPE), mask=ok)
        # The rope key, as kernels/rope.py rotates it (halves out in both layouts).
        i = tl.arange(0, BLOCK_HALF)
        i_ok = i < HALF
        c = tl.load(cos_ptr + tok * stride_c + i, mask=i_ok, other=0.0)
        s = tl.load(sin_ptr + tok * stride_s + i, mask=i_ok, other=0.0)
        if INTERLEAVE:
            x1 = tl.load(row + C + 2 * i, mask=i_ok, other=0.0).to(tl.float32)
            x2 = tl.load(row + C + 2 * i + 1, mask=i_ok, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(row + C + i, mask=i_ok, other=0.0).to(tl.float32)
            x2 = tl.load(row + C + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
        tl.store(out_row + C + i, cast_rne(x1 * c - x2 * s, DTYPE), mask=i_ok)
        tl.store(out_row + C + HALF + i, cast_rne(x2 * c + x1 * s, DTYPE), mask=i_ok)


def latent_triton(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool) -> torch.Tensor:
    """The Triton kernel; see `norm_rope_latent` for the contract."""
    if triton is None:
        raise RuntimeError("triton is not available")
    if kv.dim() != 2:
        raise ValueError(f"kv must be [T, C + R], got {tuple(kv.shape)}")
    t, d = kv.shape
    c = weight.shape[0]
    rope = d - c
    if weight.dim() != 1 or c > MAX_KV_LORA or rope <= 0 or rope % 2:
        raise ValueError(f"weight must be [C] with C <= {MAX_KV_LORA} and an even rope part after it, "
                         f"got weight {tuple(weight.shape)} for rows of {d}")
    if kv.dtype not in _KERNEL_DTYPES or weight.dtype != kv.dtype:
        raise ValueError(f"kv and weight must share one of float32/bfloat16/float16, got {kv.dtype}, {weight.dtype}")
    half = rope // 2
    if cos.shape != (t, half) or sin.shape != (t, half) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos and sin must be float32 [{t}, {half}]")
    out = torch.empty(t, d, dtype=kv.dtype, device=kv.device)
    if t == 0:
        return out
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_c = triton.next_power_of_2(c)
    _latent_kernel[(t,)](
        kv, weight.contiguous(), cos, sin, out, c, kv.stride(0), cos.stride(0), sin.stride(0), float(eps),
        HALF=half, BLOCK_C=block_c, BLOCK_HALF=triton.next_power_of_2(half), INTERLEAVE=bool(interleave),
        num_warps=max(1, min(8, block_c // 512)),
        enable_fp_fusion=False,  # the rounding the interpreter (and so the CPU tests) sees
    )
    return out


def norm_rope_latent(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     interleave: bool) -> torch.Tensor:
    """[rms_norm(c_kv) * weight | rope(k_rope)] for kv [T, C + R] = [c_kv | k_rope] (a strided
    view is fine), weight [C], fp32 rope tables cos/sin [T, R/2]; [T, C + R], contiguous, in
    kv's dtype. Triton on CUDA tensors (on CPU only under TRITON_INTERPRET=1 and
    WIDEEP_CPU_KERNELS=1) when kv and weight share a float dtype, the references otherwise."""
    c = weight.shape[0]
    use_kernel = (triton is not None and triton_ok(kv) and kv.dim() == 2 and kv.dtype in _KERNEL_DTYPES
                  and weight.dtype == kv.dtype and c <= MAX_KV_LORA and (kv.shape[1] - c) % 2 == 0
                  and kv.shape[1] > c and cos.dtype == sin.dtype == torch.float32
                  and not (torch.is_grad_enabled() and (kv.requires_grad or weight.requires_grad)))
    if not use_kernel:
        return latent_reference(kv, weight, eps, cos, sin, interleave)
    return kernel_or_reference("norm_rope_latent", latent_triton, latent_reference, kv, weight, eps, cos, sin,
                               interleave)


__all__ = ["latent_reference", "latent_triton", "norm_rope_latent"]
