"""y = x @ w.T for the few rows of a decode step: split over K, summed in one launch.

At decode sizes (up to 64 rows) a projection reads its whole weight to produce a few rows, so it
should run at the HBM copy bandwidth. cuBLAS picks tiles over N only for such shapes: an 8 MB
weight (2048 x 2048 bf16) becomes ~90 tiles on 132 SMs, about 1.4 TB/s on an H200 (bench
profiles in RESULTS). Here the K range is split too, so several hundred programs stream the
weight at once. The partial sums meet in an fp32 workspace by atomic adds; the last program of
a column tile (a counter per tile) writes the output, then zeroes its workspace tile and its
counter for the next call. So one launch does it all, the workspace stays zero between calls,
and a CUDA graph can replay it.

Each weight gets its own workspace (the layers run one after another, never concurrently),
made outside any CUDA-graph capture; where none exists during a capture, or no measured
configuration says this kernel wins for the shape (kernels/tuned/<gpu>.json, "skinny_gemm"),
`linear` is F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_ok
from .tuning import tuned_config

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

MAX_ROWS = 64  # the workspace's rows; more rows than this take F.linear

if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr, DOT_FP32: tl.constexpr):
        tile = tl.program_id(0)
        part = tl.program_id(1)
        rows = tl.arange(0, BM)
        cols = tile * BN + tl.arange(0, BN)
        row_ok = rows < M
        col_ok = cols < N
        ks = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        k_start = part * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        for k0 in range(k_start, k_end, BK):
            k_ok = k0 + ks < k_end
            a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k0 + ks)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if DOT_FP32:  # the interpreter's bf16 dot is not exact (see kernels/moe_gemm.py)
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
        out_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if SPLIT == 1:
            tl.store(out_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            ws = ws_ptr + rows[:, None] * N + cols[None, :]
            tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
            tl.debug_barrier()  # every thread's adds are issued before the counter is
            arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:  # the last part of this tile: its sum is complete
                total = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.store(ws, tl.zeros([BM, BN], dtype=tl.float32), mask=mask)
                tl.atomic_xchg(count_ptr + tile, 0)


def rows_bucket(m: int) -> int:
    return 1 if m == 1 else 16 if m <= 16 else 64


def tune_key(m: int, n: int, k: int) -> str:
    return f"m{rows_bucket(m)}|n{n}|k{k}"


class Workspace:
    """A weight's fp32 partial sums [MAX_ROWS, N] and arrival counters, zero between calls."""

    def __init__(self, n: int, device: torch.device):
        self.sums = torch.zeros(MAX_ROWS, n, dtype=torch.float32, device=device)
        self.counts = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)


_workspaces: dict[tuple[int, int], Workspace] = {}


def workspace_for(weight: torch.Tensor) -> Workspace | None:
    """The weight's workspace; None during a CUDA-graph capture if it has none yet (a capture
    records a zero fill instead of running it)."""
    key = (weight.data_ptr(), weight.shape[0])
    ws = _workspaces.get(key)
    if ws is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        ws = _workspaces[key] = Workspace(weight.shape[0], weight.device)
    return ws


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int = 32, block_k: int = 128, split: int = 4,
                  num_warps: int = 4, num_stages: int = 3, ws: Workspace | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x's dtype, M <= MAX_ROWS; fp32 sums."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"skinny_linear takes up to {MAX_ROWS} rows of width {weight.shape[1]}, got {tuple(x.shape)}")
    if block_n < 16 or split < 1:
        raise ValueError("block_n must be at least 16 and split at least 1")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    ws = ws or workspace_for(weight) or Workspace(n, x.device)
    if ws.counts.numel() < triton.cdiv(n, block_n):
        raise ValueError("workspace too small")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    _skinny_kernel[(triton.cdiv(n, block_n), split)](
        x, weight, y, ws.sums, ws.counts, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per_split,
        BM=max(16, triton.next_power_of_2(m)), BN=block_n, BK=block_k, SPLIT=split, DOT_FP32=not x.is_cuda,
        num_warps=num_warps, num_stages=num_stages)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or skinny_linear where this GPU's tuned table says it is faster for the shape."""
    if (bias is None and triton is not None and x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and triton_ok(x)):
        cfg = tuned_config(x.device, "skinny_gemm", tune_key(x.shape[0], weight.shape[0], weight.shape[1]))
        if cfg is not None and cfg.get("skinny"):
            ws = workspace_for(weight)
            if ws is not None:
                return skinny_linear(x, weight, cfg["block_n"], cfg["block_k"], cfg["split"],
                                     cfg["num_warps"], cfg["num_stages"], ws)
    return F.linear(x, weight, bias)
