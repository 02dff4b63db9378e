"""The indexer's top-k for a few narrow rows: each row whole in one program, no barriers.

The one-launch select (wideep_kernels/row_select.py) splits a row over programs that meet at a
barrier between its six phases. At batch 1 and 8K a row has 16 programs and the select took
14 us a layer on an H100, about 14% of the decode step, nearly all of it the phases' round
trips through global memory, not the 32 KB it reads. Here one program of many warps holds the
whole row (up to MAX_WIDTH positions) in registers and runs the same radix select: four byte
histograms from the top of the order keys, each narrowing the keys that still match the k-th
largest, then the positions above the k-th key and the latest ones equal to it, placed by prefix
sums. Every step is within the program, so its barriers are the CTA's own.

Positions at or past g_len are never read and never chosen; a row with g_len <= k takes all its
live positions. Output order is not the reference's (the indexer's callers treat it as a set).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .radix_select import _matching_histogram
    from .row_select import _order_key, _pick_digit
except Exception:  # a CPU-only install without triton: the indexer never asks for this
    triton = None
    tl = None

# Widest row a program holds (fp32 scores, order keys and positions in registers: 16K positions
# at 16 warps are 32 of each a thread).
MAX_WIDTH = 16384
# Batches of up to this many rows take it (0: never). WIDEEP_SMALL_SELECT_ROWS sets it.
MAX_ROWS = int(os.environ.get("WIDEEP_SMALL_SELECT_ROWS", "0"))
# Narrower rows share the build of this width.
MIN_BUILD_WIDTH = 1024


def use_small_select(num_seqs: int, width: int) -> bool:
    """Whether `num_seqs` rows of `width` positions take this select (MAX_ROWS, MAX_WIDTH)."""
    return 0 < num_seqs <= MAX_ROWS and width <= MAX_WIDTH


if triton is not None:

    @triton.jit(do_not_specialize=["width", "k"])
    def _small_select_kernel(scores_ptr, lens_ptr, out_ptr, stride_sb, stride_ob, width, k,
                             TOPK: tl.constexpr, W: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        seq = tl.program_id(0)
        g_len = tl.minimum(tl.load(lens_ptr + seq), width)
        kk = tl.minimum(k, g_len)
        pos = tl.arange(0, W)
        live = pos < g_len
        s = tl.load(scores_ptr + seq * stride_sb + pos, mask=live, other=0.0)
        key = _order_key(s)
        out_row = out_ptr + seq * stride_ob
        if kk > 0:
            # The k-th largest live key, byte by byte from the top; `rank` ends as the number of
            # keys equal to it that belong to the top k.
            prefix = tl.zeros([], dtype=tl.uint32)
            rank = kk
            match = live
            for p in tl.static_range(4):
                shift = 24 - 8 * p
                h = _matching_histogram(((key >> shift) & 0xFF).to(tl.int32), match, W)
                digit, rank = _pick_digit(h, rank)
                prefix = prefix | (digit.to(tl.uint32) << shift)
                match = match & (((key >> shift) & 0xFF) == digit.to(tl.uint32))
            above = live & (key > prefix)
            # equal keys: the latest positions first (the reference's tie rule)
            equal = match.to(tl.int32)
            from_end = tl.sum(equal, axis=0) - tl.cumsum(equal, axis=0) + equal
            take = match & (from_end <= rank)
            n_above = kk - rank
            place = tl.where(above, tl.cumsum(above.to(tl.int32), axis=0) - 1, n_above + from_end - 1)
            tl.store(out_row + place, pos, mask=above | take)
        # -1 after the row's positions
        for start in tl.static_range(0, TOPK, FILL):
            fill = start + tl.arange(0, FILL)
            tl.store(out_row + fill, tl.full([FILL], -1, tl.int32), mask=(fill >= kk) & (fill < TOPK))


def small_select(scores: torch.Tensor, g_lens: torch.Tensor, out: torch.Tensor, k: int) -> torch.Tensor:
    """Write into out [B, topk] int32 the positions of each row's k highest live scores (equal
    scores: latest position first; positions >= g_len never), -1 after them. scores [B, width]
    fp32 with width <= MAX_WIDTH; g_lens int32 on the scores' device; 1 <= k <= width."""
    num_seqs, width = scores.shape
    topk = out.shape[1]
    if width > MAX_WIDTH:
        raise ValueError(f"rows of {width} positions are wider than small_select's {MAX_WIDTH}")
    if not 1 <= k <= min(width, topk):
        raise ValueError(f"k must be in [1, {min(width, topk)}], got {k}")
    if num_seqs == 0:
        return out
    w = max(MIN_BUILD_WIDTH, triton.next_power_of_2(width))
    _small_select_kernel[(num_seqs,)](
        scores, g_lens, out, scores.stride(0), out.stride(0), width, k,
        TOPK=topk, W=w, FILL=min(1024, triton.next_power_of_2(topk)), num_warps=16 if w >= 8192 else 8,
        **pdl_launch(scores))
    return out
