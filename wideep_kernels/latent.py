"""A token's MLA latent in one kernel launch: the RMSNorm of its compressed KV and the rotary
embedding of its rope key, written side by side.

The attention layer's fused input GEMM yields [c_kv | k_rope] per token; the latent the caches
keep is [rms_norm(c_kv) | rope(k_rope)]. As torch (or as our norm and rope kernels, then a
concatenation) that is three launches a layer; here one program does one token.

`latent_reference` defines the semantics from the two references (wideep_kernels/rmsnorm.py,
wideep_kernels/rope.py); `latent_triton` rounds exactly as they do; `norm_rope_latent` picks one.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok
from .fp8_kv import FP8_DTYPE, quantize_kv
from .fp8_kv import FP8_MAX as _FP8_MAX, MIN_AMAX as _MIN_AMAX
from .rmsnorm import rms_norm, rms_norm_reference
from .rope import apply_rope_reference

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
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
    FP8_MAX = tl.constexpr(_FP8_MAX)
    MIN_AMAX = tl.constexpr(_MIN_AMAX)

    @triton.jit
    def _e4m3_bits(x):
        """The E4M3 byte of fp32 x (|x| <= 448) rounded to nearest, ties to even, as torch's cast
        gives it, -0 included; built from bits, so neither the interpreter's cast (not RNE) nor
        the GPU's (which gave +0 for a tiny negative) decides it. The spacing is 2^(e - 3) for
        2^e <= |x| (e >= -6), 2^-9 below; adding and taking away 1.5 * 2^23 rounds |x| / spacing
        (< 16) to an integer, ties to even."""
        ax = tl.abs(x)
        e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
        step = ((e + 127) << 23).to(tl.float32, bitcast=True)
        inv_step = ((127 - e) << 23).to(tl.float32, bitcast=True)  # powers of two: exact products
        r = ((ax * inv_step + 12582912.0) - 12582912.0) * step  # an E4M3 value now
        bits = r.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) - 127
        normal = ((exp + 7) << 3) | ((bits >> 20) & 0x7)
        subnormal = (r * 512.0).to(tl.int32)  # 0 .. 7 units of 2^-9
        sign = ((x.to(tl.int32, bitcast=True) >> 31) & 1) << 7
        return (tl.where(exp >= -6, normal, subnormal) | sign).to(tl.uint8)

    @triton.jit
    def _latent_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, C, stride_kv, stride_c, stride_s, eps,
                       q_ptr, q_w_ptr, q_out_ptr, QC, stride_q, q_eps,
                       slot_ptr, slab_ptr, key_ptr, key_slab_ptr, KD, stride_key, key_scale_ptr,
                       HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       INTERLEAVE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEY: tl.constexpr,
                       KEY_FP8: tl.constexpr = False, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        tok = tl.program_id(0).to(tl.int64)
        DTYPE: tl.constexpr = out_ptr.dtype.element_ty
        row = kv_ptr + tok * stride_kv
        out_row = out_ptr + tok * (C + 2 * HALF)
        if BLOCK_KEY > 0:  # the global slab's row of this token (every token writes one)
            slab_row = slab_ptr + tl.load(slot_ptr + tok).to(tl.int64) * (C + 2 * HALF)
        # The norm, rounded as wideep_kernels/rmsnorm.py rounds it.
        cols = tl.arange(0, BLOCK_C)
        ok = cols < C
        x = tl.load(row + cols, mask=ok, other=0.0).to(tl.float32)
        y = cast_rne(x * _rstd(tl.sum(x * x, axis=0), C, eps), DTYPE).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        normed = cast_rne(w * y, DTYPE)
        tl.store(out_row + cols, normed, mask=ok)
        if BLOCK_KEY > 0:
            tl.store(slab_row + cols, normed, mask=ok)
        # The rope key, as wideep_kernels/rope.py rotates it (halves out in both layouts).
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
        r1 = cast_rne(x1 * c - x2 * s, DTYPE)
        r2 = cast_rne(x2 * c + x1 * s, DTYPE)
        tl.store(out_row + C + i, r1, mask=i_ok)
        tl.store(out_row + C + HALF + i, r2, mask=i_ok)
        if BLOCK_KEY > 0:
            tl.store(slab_row + C + i, r1, mask=i_ok)
            tl.store(slab_row + C + HALF + i, r2, mask=i_ok)
            # the indexer key beside it, copied as it is or quantised as wideep_kernels/fp8_kv.py
            # quantize_kv does (IEEE divisions, so the bytes and the scale are its own)
            d = tl.arange(0, BLOCK_KEY)
            d_ok = d < KD
            key = tl.load(key_ptr + tok * stride_key + d, mask=d_ok, other=0.0)
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if KEY_FP8:
                kf = key.to(tl.float32)
                scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(kf), axis=0), MIN_AMAX), FP8_MAX)
                key = _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(kf, scale), -FP8_MAX), FP8_MAX))
                tl.store(key_scale_ptr + slot, scale)
                tl.store(key_slab_ptr.to(tl.pointer_type(tl.uint8)) + slot * KD + d, key, mask=d_ok)
            else:
                tl.store(key_slab_ptr + slot * KD + d, key.to(key_slab_ptr.dtype.element_ty), mask=d_ok)
        if BLOCK_Q > 0:  # the query's low-rank part, normed as wideep_kernels/rmsnorm.py does
            qc = tl.arange(0, BLOCK_Q)
            q_ok = qc < QC
            xq = tl.load(q_ptr + tok * stride_q + qc, mask=q_ok, other=0.0).to(tl.float32)
            yq = cast_rne(xq * _rstd(tl.sum(xq * xq, axis=0), QC, q_eps), DTYPE).to(tl.float32)
            wq = tl.load(q_w_ptr + qc, mask=q_ok, other=0.0).to(tl.float32)
            tl.store(q_out_ptr + tok * QC + qc, cast_rne(wq * yq, DTYPE), mask=q_ok)


def latent_triton(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, q_norm: tuple | None = None, write: tuple | None = None):
    """The Triton kernel; see `norm_rope_latent` (and `latent_and_query` for q_norm and write)."""
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
    q, q_weight, q_eps = q_norm if q_norm is not None else (None, None, 0.0)
    q_out = None
    if q is not None:
        if q.dim() != 2 or q.shape[0] != t or q_weight.shape != (q.shape[1],) or q.dtype != kv.dtype \
                or q_weight.dtype != kv.dtype or q.shape[1] > MAX_KV_LORA or q.stride(-1) != 1:
            raise ValueError(f"q_norm needs q [{t}, Q] (unit stride) and weight [Q] in {kv.dtype}, Q <= {MAX_KV_LORA}")
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    slots = slab = key = key_slab = key_scale = None
    if write is not None:
        slots, slab, key, key_slab, key_scale = (*write, None)[:5]
        if slab.dim() != 2 or slab.shape[1] != d or slab.dtype != kv.dtype or not slab.is_contiguous() \
                or slots.shape != (t,) or key.dim() != 2 or key.shape[0] != t or key.stride(-1) != 1 \
                or key_slab.dim() != 2 or key_slab.shape[1] != key.shape[1] or not key_slab.is_contiguous():
            raise ValueError("write needs slots [T], a contiguous [S, C + R] slab in kv's dtype, index keys "
                             "[T, Di] (unit stride) and a contiguous [S, Di] index slab")
        if (key_slab.dtype == FP8_DTYPE) != (key_scale is not None) or key_scale is not None and (
                key_scale.shape != (key_slab.shape[0],) or key_scale.dtype != torch.float32
                or not key_scale.is_contiguous()):
            raise ValueError("an FP8 index slab needs its scales, a contiguous float32 [S] (and only it does)")
    if t == 0:
        return (out, q_out) if q_norm is not None else out
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    block_c = triton.next_power_of_2(c)
    block_q = triton.next_power_of_2(q.shape[1]) if q is not None else 0
    _latent_kernel[(t,)](
        kv, weight.contiguous(), cos, sin, out, c, kv.stride(0), cos.stride(0), sin.stride(0), float(eps),
        q if q is not None else kv, q_weight.contiguous() if q is not None else weight, q_out if q is not None else out,
        q.shape[1] if q is not None else 0, q.stride(0) if q is not None else 0, float(q_eps),
        slots if write is not None else kv, slab if write is not None else out, key if write is not None else kv,
        key_slab if write is not None else out, key.shape[1] if write is not None else 0,
        key.stride(0) if write is not None else 0, key_scale if key_scale is not None else out,
        HALF=half, BLOCK_C=block_c, BLOCK_HALF=triton.next_power_of_2(half), INTERLEAVE=bool(interleave),
        BLOCK_Q=block_q, BLOCK_KEY=triton.next_power_of_2(key.shape[1]) if write is not None else 0,
        KEY_FP8=key_scale is not None,
        num_warps=max(1, min(8, max(block_c, block_q) // 512)),
        enable_fp_fusion=False,  # the rounding the interpreter (and so the CPU tests) sees
        **pdl_launch(kv))
    return (out, q_out) if q_norm is not None else out


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


def latent_and_query(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                     interleave: bool, q: torch.Tensor, q_weight: torch.Tensor, q_eps: float,
                     write: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_rope_latent(kv, ...), rms_norm(q, q_weight, q_eps)) in one launch on GPU: an
    attention layer's latent and its query's low-rank part, both read from the input GEMM.
    `write` = (slots [T], slab [S, C + R], index_key [T, Di], index_slab [S, Di][, index_scale
    [S]]): also store each token's latent at slab[slots] and its indexer key at index_slab[slots]
    (a KV-source layer's cache write at decode, in kv's dtype; an FP8 index slab takes the key
    quantised as wideep_kernels/fp8_kv.py quantize_kv does, its scale at index_scale[slots]; the slots
    of padding rows may repeat, and such a slot then holds each element from one of its rows, in
    no set order).
    Falls back to the references (and torch writes) where the kernel does not apply."""
    use_kernel = (triton is not None and triton_ok(kv) and kv.dim() == 2 and kv.dtype in _KERNEL_DTYPES
                  and weight.dtype == kv.dtype and weight.shape[0] <= MAX_KV_LORA
                  and (kv.shape[1] - weight.shape[0]) % 2 == 0 and kv.shape[1] > weight.shape[0]
                  and cos.dtype == sin.dtype == torch.float32 and q.dtype == q_weight.dtype == kv.dtype
                  and q.shape[-1] <= MAX_KV_LORA and q.stride(-1) == 1 and not torch.is_grad_enabled()
                  and (write is None or (write[1].dtype == kv.dtype and write[1].is_contiguous()
                                         and write[3].is_contiguous() and write[2].stride(-1) == 1)))
    fn = kernel_or_reference if use_kernel else (lambda name, kernel, reference, *args: reference(*args))
    return fn("latent_and_query", latent_triton, latent_and_query_reference, kv, weight, eps, cos, sin, interleave,
              (q, q_weight, q_eps), write)


def latent_and_query_reference(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                               sin: torch.Tensor, interleave: bool, q_norm: tuple,
                               write: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    latent = norm_rope_latent(kv, weight, eps, cos, sin, interleave)
    if write is not None:
        slots, slab, key, key_slab, key_scale = (*write, None)[:5]
        slab[slots] = latent.to(slab.dtype)
        if key_scale is not None:
            key, key_scale[slots] = quantize_kv(key)
        key_slab[slots] = key.to(key_slab.dtype)
    return latent, rms_norm(*q_norm)


__all__ = ["latent_reference", "latent_triton", "norm_rope_latent", "latent_and_query", "latent_and_query_reference"]
