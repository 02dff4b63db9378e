"""Linear layers of a decode step at batch 1: out = W @ x, W [N, K] read once.

At batch 1 a projection is a weight read of a few MB, and cuBLAS's small-batch GEMM
takes about twice the read's time on an H200 (5.1 us for the bench model's 7.9 MB input
projection, bench.forward's batch-1 profile). Here each program holds BLOCK_N whole rows of W in
registers, and loads them *before* its programmatic-dependent-launch wait (wideep_kernels/pdl.py):
weights are written by nothing a decode step runs, so the read overlaps the end of the kernel
before, and only the short x read and the sums wait for it. (Weights are written only when
loaded and when a fused weight is first concatenated, by torch kernels: a kernel that does not
release its dependents early releases them only when all of its programs have finished.)

Products and sums are in fp32, rounded once to x's dtype (cuBLAS sums in another order, so the
last bit may differ).

`norm_gemv_triton` also takes the RMSNorm before the projection (and the residual add before
that): every program normalises the row itself, so the norm needs no launch of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .rmsnorm import _rstd, cast_rne
except Exception:  # the torch path needs no Triton
    triton = None

MAX_K = 2048      # a program's BLOCK_N rows of W stay in registers up to this width
BLOCK_N = 8
_DTYPES = (torch.bfloat16, torch.float16)

if triton is not None:
    @triton.jit
    def _weight_rows(w_ptr, stride_wn, N, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's BLOCK_N rows of W (whole rows, K wide) and their indices and masks."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        n_ok = rows < N
        k_ok = ks < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return w, rows, ks, n_ok, k_ok

    @triton.jit(do_not_specialize=["N"])
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, stride_wn,
                     K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
        # The weights before the wait: no kernel of the step writes them.
        w, rows, ks, n_ok, k_ok = _weight_rows(w_ptr, stride_wn, N, K, BLOCK_K, BLOCK_N)
        pdl_enter(PDL)
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit(do_not_specialize=["N"])
    def _norm_gemv_kernel(x_ptr, res_ptr, norm_w_ptr, w_ptr, out_ptr, stream_ptr, N, stride_wn, eps,
                          K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = 0):
        # The projection's and the norm's weights before the wait: no kernel of the step writes them.
        w, rows, ks, n_ok, k_ok = _weight_rows(w_ptr, stride_wn, N, K, BLOCK_K, BLOCK_N)
        norm_w = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        pdl_enter(PDL)
        # Every program normalises the whole row itself (a few KB from L2): that is what saves
        # the norm's launch. The arithmetic is wideep_kernels/rmsnorm.py's, rounding for rounding.
        X_DTYPE: tl.constexpr = w_ptr.dtype.element_ty
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            if x_ptr.dtype.element_ty != X_DTYPE:  # the routed experts' unrounded fp32 sum
                x = cast_rne(x, X_DTYPE).to(tl.float32)
            r = tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            h = cast_rne(x + r, X_DTYPE)
            if tl.program_id(0) == 0:
                tl.store(stream_ptr + ks, h, mask=k_ok)
            x = h.to(tl.float32)
        rstd = _rstd(tl.sum(x * x, axis=0), K, eps)
        y = cast_rne(norm_w * cast_rne(x * rstd, X_DTYPE).to(tl.float32), X_DTYPE).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * y[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (triton is not None and bias is None and x.dim() == 2 and x.shape[0] == 1
            and x.shape[1] <= MAX_K and x.dtype in _DTYPES and weight.dtype == x.dtype and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and weight.shape[0] > 0 and x.stride(1) == 1 and weight.stride(1) == 1
            and weight.device == x.device and triton_ok(x))


def gemv_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] (K <= MAX_K, its elements contiguous) @ weight [N, K]^T -> [1, N] in x's dtype."""
    k = x.shape[1]
    n = weight.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    _gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, weight, out, n, weight.stride(0), K=k, BLOCK_K=block_k, BLOCK_N=BLOCK_N,
        num_warps=8 if block_k >= 2048 else 4, **pdl_launch(x))
    return out


def norm_gemv_applies(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether norm_gemv_triton takes this norm and projection: gemv_applies for the normalised
    row (the norm's weight in the projection's dtype), and an x that is the residual's dtype or
    an fp32 sum on it."""
    row = x if residual is None else residual
    return (gemv_applies(row, weight, bias) and norm_weight.dtype == weight.dtype
            and norm_weight.shape == (x.shape[1],) and norm_weight.stride(0) == 1 and x.stride(1) == 1
            and x.shape == row.shape and x.dtype in (row.dtype, torch.float32) and x.device == row.device)


def norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, stream: torch.Tensor | None = None) -> torch.Tensor:
    """linear(rms_norm(h), weight) for one row h = x + residual (h = x without a residual), the
    norm computed by every program of the GEMV instead of by a launch of its own. The residual
    stream h is written into `stream` (needed with a residual). The norm rounds as
    wideep_kernels/rmsnorm.py add_rms_norm does; the products and sums as gemv_triton."""
    k, n = x.shape[1], weight.shape[0]
    if residual is not None and (stream is None or stream.shape != residual.shape
                                 or stream.dtype != residual.dtype or not stream.is_contiguous()):
        raise ValueError("a residual needs a contiguous `stream` tensor of its shape and dtype")
    out = torch.empty(1, n, dtype=weight.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    _norm_gemv_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, residual if residual is not None else x, norm_weight, weight, out,
        stream if stream is not None else out, n, weight.stride(0), float(eps),
        K=k, BLOCK_K=block_k, BLOCK_N=BLOCK_N, HAS_RESIDUAL=residual is not None,
        num_warps=8 if block_k >= 2048 else 4, enable_fp_fusion=False, **pdl_launch(x))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel above where it applies (one row on a GPU, bf16 or fp16, no
    bias, K <= MAX_K). On the H200 with the bench model it took the batch-1 decode step from 1.489
    to 1.435 ms; four rows in one program were slower than cuBLAS at batch 4 (2.066 against
    2.050 ms; RESULTS, twelfth session), so more rows stay on cuBLAS."""
    if gemv_applies(x, weight, bias):
        return gemv_triton(x, weight)
    return F.linear(x, weight, bias)
