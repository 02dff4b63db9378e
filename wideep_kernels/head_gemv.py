"""Per-head projections of MLA decode at small batch: out[t, h, n] = sum_k x[t, h, k] w[h, k, n].

Two of them run in every attention layer of a decode step: the query absorbed into the latent
space (x: the query's no-rope part [T, H, 128], w: kv_b_proj's key rows [H, 128, 512]) and the
value up-projection (x: attention's latent output [T, H, 512], w: kv_b_proj's value rows,
transposed [H, 512, 128]). At batch 1 each is a 2 MB weight read that cuBLAS's batched GEMM
took 2.7-3.3 us for on an H200, and a kernel that is not ours cannot
take part in dependent launches (wideep_kernels/pdl.py): the kernel after it waits for its end.

Each program holds a [K, BLOCK_N] tile of one head's weight in registers, loaded before its
dependent-launch wait (nothing in a decode step writes weights; wideep_kernels/gemv.py), then computes
its BLOCK_N outputs for every row. Products and sums in fp32, rounded once to x's dtype.
"""
from __future__ import annotations

import torch

from . import triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
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
                          K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
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


def head_gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] and w [H, K, N] (any strides) -> [T, H, N] in x's dtype."""
    return torch.einsum("thk,hkn->thn", x, w)


def head_gemv_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (triton is not None and x.dim() == 3 and w.dim() == 3 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1] == w.shape[0] and x.shape[2] == w.shape[1] and x.dtype in _DTYPES
            and w.dtype == x.dtype and x.stride(2) == 1 and w.device == x.device
            and triton.next_power_of_2(x.shape[2]) <= TILE_ELEMENTS and triton_ok(x))


def head_gemv_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t, h, k = x.shape
    n = w.shape[2]
    out = torch.empty(t, h, n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(triton.next_power_of_2(n), TILE_ELEMENTS // block_k))
    _head_gemv_kernel[(h, triton.cdiv(n, block_n))](
        x, w, out, t, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        out.stride(1), K=k, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4, **pdl_launch(x))
    return out


def head_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (its last dim contiguous) times each head's w [H, K, N] -> [T, H, N]: the
    kernel above where it applies (a GPU, bf16 or fp16, at most MAX_ROWS rows), else torch."""
    if head_gemv_applies(x, w):
        return head_gemv_triton(x, w)
    return head_gemv_reference(x, w)
