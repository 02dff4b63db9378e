"""Per-head projections of MLA decode at small batch: out[t, h, n] = sum_k x[t, h, k] w[h, k, n].

Two of them run in every attention layer of a decode step: the query absorbed into the latent
space (x: the query's no-rope part [T, H, 128], w: kv_b_proj's key rows [H, 128, 512]) and the
value up-projection (x: attention's latent output [T, H, 512], w: kv_b_proj's value rows,
transposed [H, 512, 128]). At batch 1 each is a 2 MB weight read that cuBLAS's batched GEMM
took 2.7-3.3 us for on an H200, and a kernel that is not ours cannot
take part in dependent launches (kernels/pdl.py): the kernel after it waits for its end.

Each program holds a [K, BLOCK_N] tile of one head's weight in registers, loaded before its
dependent-launch wait (nothing in a decode step writes weights; kernels/gemv.py), then computes
its BLOCK_N outputs for every row. Products and sums in fp32, rounded once to x's dtype.
The absorption's launch can also rotate the query's rope part (`rope`), each head's first
program its head: the rope's launch saved.
"""
from __future__ import annotations

import torch

from . import triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .rope import rotate
except Exception:  # the torch path needs no Triton
    triton = None

# Each row repeats the program's whole multiply: on the H200 (bench.kernel_head_gemv) the kernel
# took 1.7 against cuBLAS's 2.7-3.3 us at one row, 2.2-2.6 against 3.0-3.3 at two, and lost from
# four rows on (3.9 against 3.0 for the absorption).
MAX_ROWS = 2
TILE_ELEMENTS = 8192  # of one program's weight tile: 64 bf16 values a thread at 4 warps
_DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _head_gemv_kernel(x_ptr, w_ptr, out_ptr, T, N, sx_t, sx_h, sw_h, sw_k, sw_n, so_t, so_h,
                          xr_ptr, cos_ptr, sin_ptr, ro_ptr, sxr_t, sxr_h, sc_t, ss_t,
                          K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          ROPE_HALF: tl.constexpr = 0, BLOCK_HALF: tl.constexpr = 1, INTERLEAVE: tl.constexpr = 0,
                          PDL: tl.constexpr = 0):
        h = tl.program_id(0)
        ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        n_ok = ns < N
        k_ok = ks < K
        # The weights before the wait: no kernel of the step writes them.
        w = tl.load(w_ptr + h.to(tl.int64) * sw_h + ks[:, None] * sw_k + ns[None, :] * sw_n,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        pdl_enter(PDL)
        w = w.to(tl.float32)
        for t in range(T):
            x = tl.load(x_ptr + t * sx_t + h * sx_h + ks, mask=k_ok, other=0.0).to(tl.float32)
            acc = tl.sum(w * x[:, None], axis=0)
            tl.store(out_ptr + t * so_t + h * so_h + ns, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
        if ROPE_HALF > 0:
            # The query's rope part, rotated by the head's first program: the rope's launch saved.
            if tl.program_id(1) == 0:
                i = tl.arange(0, BLOCK_HALF)
                i_ok = i < ROPE_HALF
                for t in range(T):
                    c = tl.load(cos_ptr + t * sc_t + i, mask=i_ok, other=0.0)
                    s = tl.load(sin_ptr + t * ss_t + i, mask=i_ok, other=0.0)
                    rotate(xr_ptr + t * sxr_t + h * sxr_h, ro_ptr + (t * tl.num_programs(0) + h) * (2 * ROPE_HALF),
                           c, s, i, i_ok, ROPE_HALF, INTERLEAVE)


def head_gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] and w [H, K, N] (any strides) -> [T, H, N] in x's dtype."""
    return torch.einsum("thk,hkn->thn", x, w)


def head_gemv_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (triton is not None and x.dim() == 3 and w.dim() == 3 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[1] and x.dtype in _DTYPES
            and w.dtype == x.dtype and x.stride(2) == 1 and w.device == x.device
            and triton.next_power_of_2(x.shape[2]) <= TILE_ELEMENTS and triton_ok(x))


def head_gemv_triton(x: torch.Tensor, w: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool] | None = None):
    """x [T, H, K] times each head's w [H, K, N] -> [T, H, N]. With `rope` (x_rope [T, H, R],
    cos, sin [T, R/2] fp32, interleave) also x_rope rotated as kernels/rope.py apply_rope does,
    bit for bit, in the same launch: returns (out, rotated)."""
    t, h, k = x.shape
    n = w.shape[2]
    out = torch.empty(t, h, n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(triton.next_power_of_2(n), TILE_ELEMENTS // block_k))
    rope_args, rope_consts, rotated = [out] * 4 + [0] * 4, {}, None  # pointers not read without ROPE_HALF
    if rope is not None:
        xr, cos, sin, interleave = rope
        half = xr.shape[2] // 2
        if (xr.shape[:2] != (t, h) or xr.shape[2] % 2 or xr.stride(2) != 1 or xr.dtype != x.dtype
                or cos.shape != (t, half) or sin.shape != (t, half) or cos.dtype != torch.float32
                or sin.dtype != torch.float32 or cos.stride(1) != 1 or sin.stride(1) != 1):
            raise ValueError(f"rope: x_rope [{t}, {h}, even] in x's dtype, last dim contiguous, and fp32 cos, sin "
                             f"[{t}, half] with contiguous rows; got {tuple(xr.shape)} {xr.dtype}, "
                             f"{tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)} {sin.dtype}")
        rotated = torch.empty(t, h, 2 * half, dtype=x.dtype, device=x.device)
        rope_args = [xr, cos, sin, rotated, xr.stride(0), xr.stride(1), cos.stride(0), sin.stride(0)]
        rope_consts = dict(ROPE_HALF=half, BLOCK_HALF=triton.next_power_of_2(half), INTERLEAVE=bool(interleave),
                           enable_fp_fusion=False)
    _head_gemv_kernel[(h, triton.cdiv(n, block_n))](
        x, w, out, t, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), *rope_args, K=k, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4, **rope_consts,
        **pdl_launch(x))
    return out if rope is None else (out, rotated)


def head_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (its last dim contiguous) times each head's w [H, K, N] -> [T, H, N]: the
    kernel above where it applies (a GPU, bf16 or fp16, at most MAX_ROWS rows), else torch."""
    if head_gemv_applies(x, w):
        return head_gemv_triton(x, w)
    return head_gemv_reference(x, w)
