"""Pairs grouped by expert slot for the fused expert kernels (wideep_kernels/moe_gemm.py): each
slot's rows start at a multiple of the row tile, so every tile of the layout reads one expert's
weights. Sized from shapes alone (the worst case, max_tiles), so nothing is read back to the host
and the layout can be built inside a CUDA graph. The router can build it in its own launch
(wideep_kernels/routing.py); align_pairs builds it from the pairs' slots.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import triton_ok

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except ImportError:  # the reference path still works without Triton
    triton = tl = None


class AlignedPairs(NamedTuple):
    row_pair: torch.Tensor   # [num_tiles * block_m] int32: pair index of each padded row, -1 for padding
    tile_slot: torch.Tensor  # [num_tiles] int32: slot of each row tile; num_slots for unused tiles
    counts: torch.Tensor     # [num_slots] int32: pairs per slot


def max_tiles(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Row tiles of the padded layout in the worst case: every non-empty slot wastes up to block_m - 1 rows."""
    if num_pairs == 0:
        return 0
    # The padded total is a multiple of block_m, so flooring the bound loses nothing.
    return (num_pairs + min(num_slots, num_pairs) * (block_m - 1)) // block_m


def align_pairs_reference(slot_of: torch.Tensor, num_slots: int, block_m: int) -> AlignedPairs:
    """Sort pairs by slot (stably) into a layout where each slot's rows start at a multiple of
    block_m. Plain tensor ops without host sync; sizes come from shapes only. Pairs of slot -1
    are dropped."""
    num_pairs = slot_of.numel()
    device = slot_of.device
    # slot -1 counts into an extra bin in front, sorts first and lands in a row past the layout
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device).scatter_add_(
        0, slot_of + 1, torch.ones_like(slot_of))[1:]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = slot_of.argsort(stable=True)
    sorted_slot = slot_of[order]
    dropped = sorted_slot < 0
    sorted_slot = sorted_slot.clamp(min=0)
    rank_in_slot = torch.arange(num_pairs, device=device) - dropped.sum() - start[sorted_slot]
    num_tiles = max_tiles(num_pairs, num_slots, block_m)
    dest = torch.where(dropped, num_tiles * block_m, padded_start[sorted_slot] + rank_in_slot)
    row_pair = torch.full((num_tiles * block_m + 1,), -1, dtype=torch.int32, device=device)
    row_pair.scatter_(0, dest, order.to(torch.int32))
    row_pair = row_pair[:-1]
    tile_start = torch.arange(num_tiles, device=device) * block_m
    tile_slot = torch.searchsorted(padded_end, tile_start, right=True, out_int32=True)
    return AlignedPairs(row_pair, tile_slot, counts.to(torch.int32))


# ---------------------------------------------------------------- Triton kernels

def _count_kernel(slot_ptr, counts_ptr, rank_ptr, num_pairs, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # The counter's old value is the pair's rank within its slot: no sort needed. The order
    # within a slot then varies from run to run, which no row's result depends on.
    pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + pairs, mask=pairs < num_pairs, other=-1)
    ok = slot >= 0  # slot -1: a dropped pair
    rank = tl.atomic_add(counts_ptr + tl.maximum(slot, 0), 1, mask=ok)
    tl.store(rank_ptr + pairs, rank, mask=ok)


def _offsets_kernel(counts_ptr, padded_start_ptr, num_slots, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                    PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # One program: exclusive prefix sum of the padded counts, a block of slots at a time
    # (a triangular masked sum inside the block).
    idx = tl.arange(0, BLOCK_S)
    running = 0
    for s0 in range(0, num_slots, BLOCK_S):
        ok = s0 + idx < num_slots
        count = tl.load(counts_ptr + s0 + idx, mask=ok, other=0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        inclusive = tl.sum(tl.where(idx[None, :] <= idx[:, None], padded[None, :], 0), axis=1)
        tl.store(padded_start_ptr + s0 + idx, running + inclusive - padded, mask=ok)
        running += tl.sum(padded, axis=0)


def _place_kernel(slot_ptr, rank_ptr, counts_ptr, padded_start_ptr, row_pair_ptr, tile_slot_ptr,
                  num_pairs, num_slots, num_tiles,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # Program i places pairs block i into their padded rows, names the slots of tiles block i and
    # marks those tiles' padding rows -1 (disjoint from the pairs' rows: no fill launch before).
    pid = tl.program_id(0)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    slot = tl.load(slot_ptr + pairs, mask=pairs < num_pairs, other=-1)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.load(rank_ptr + pairs, mask=ok, other=0)
    start = tl.load(padded_start_ptr + slot, mask=ok, other=0)
    tl.store(row_pair_ptr + start + rank, pairs, mask=ok)
    # A tile's slot = how many slots end at or before its first row (as searchsorted, right=True).
    tiles = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    first_row = tiles * BLOCK_M
    ended = tl.full((BLOCK_T,), 0, tl.int32)
    idx = tl.arange(0, BLOCK_S)
    for s0 in range(0, num_slots, BLOCK_S):
        s_ok = s0 + idx < num_slots
        count = tl.load(counts_ptr + s0 + idx, mask=s_ok, other=0)
        end = tl.load(padded_start_ptr + s0 + idx, mask=s_ok, other=0) + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        before = (end[None, :] <= first_row[:, None]) & s_ok[None, :]
        ended += tl.sum(tl.where(before, 1, 0), axis=1)
    t_ok = tiles < num_tiles
    tl.store(tile_slot_ptr + tiles, ended, mask=t_ok)
    # Rows of a tile past its slot's pairs are padding; a tile past the last slot is all padding.
    has_slot = t_ok & (ended < num_slots)
    t_count = tl.load(counts_ptr + ended, mask=has_slot, other=0)
    t_start = tl.load(padded_start_ptr + ended, mask=has_slot, other=0)
    rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = rows - t_start[:, None] >= t_count[:, None]
    tl.store(row_pair_ptr + rows, tl.full((BLOCK_T, BLOCK_M), -1, tl.int32), mask=t_ok[:, None] & pad)


def _align_one_kernel(slot_ptr, counts_ptr, padded_start_ptr, row_pair_ptr, tile_slot_ptr,
                      num_pairs, num_slots, num_tiles,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
                      PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # The three passes of align_pairs_triton in one program, for the pair counts of decode steps
    # (where each of them ran as a single program anyway). It zeroes counts itself (no fill
    # launch before it). The barriers order this program's own global writes (counts, starts)
    # before its reads of them.
    idx = tl.arange(0, BLOCK_S)
    s_ok = idx < num_slots
    tl.store(counts_ptr + idx, tl.zeros([BLOCK_S], dtype=tl.int32), mask=s_ok)
    tl.debug_barrier()
    pairs = tl.arange(0, BLOCK_P)
    slot = tl.load(slot_ptr + pairs, mask=pairs < num_pairs, other=-1)
    ok = slot >= 0  # slot -1: a dropped pair
    slot = tl.maximum(slot, 0)
    rank = tl.atomic_add(counts_ptr + slot, 1, mask=ok)  # the old value: the pair's rank in its slot
    tl.debug_barrier()
    counts = tl.load(counts_ptr + idx, mask=s_ok, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    tl.store(padded_start_ptr + idx, end - padded, mask=s_ok)
    tl.debug_barrier()
    start = tl.load(padded_start_ptr + slot, mask=ok, other=0, cache_modifier=".cg")
    tl.store(row_pair_ptr + start + rank, pairs, mask=ok)
    # A tile's slot: how many slots end at or before its first row (as searchsorted, right=True);
    # its rows past the slot's pairs are padding, and a tile past the last slot is all padding.
    for t0 in range(0, num_tiles, BLOCK_T):
        tiles = t0 + tl.arange(0, BLOCK_T)
        t_ok = tiles < num_tiles
        first_row = tiles * BLOCK_M
        ended = tl.sum(((end[None, :] <= first_row[:, None]) & s_ok[None, :]).to(tl.int32), axis=1)
        tl.store(tile_slot_ptr + tiles, ended, mask=t_ok)
        has_slot = t_ok & (ended < num_slots)
        t_count = tl.load(counts_ptr + ended, mask=has_slot, other=0, cache_modifier=".cg")
        t_start = tl.load(padded_start_ptr + ended, mask=has_slot, other=0, cache_modifier=".cg")
        rows = first_row[:, None] + tl.arange(0, BLOCK_M)[None, :]
        pad = rows - t_start[:, None] >= t_count[:, None]
        tl.store(row_pair_ptr + rows, tl.full((BLOCK_T, BLOCK_M), -1, tl.int32), mask=t_ok[:, None] & pad)


@functools.cache
def _jit(fn, *plain: str):
    # Decorated at first launch rather than at import, so that this module (and its reference
    # path) imports without Triton. `plain`: integer arguments (pair and tile counts, which follow
    # the batch) that get no build of their own when they are 1 or a multiple of 16.
    return triton.jit(fn, do_not_specialize=plain)


# Up to this many pairs the three alignment passes were one program each: one launch does all.
ALIGN_ONE_PROGRAM_PAIRS = 1024
ALIGN_ONE_PROGRAM_SLOTS = 1024


def align_pairs_triton(slot_of: torch.Tensor, num_slots: int, block_m: int) -> AlignedPairs:
    """align_pairs in three small Triton launches (the torch version launches ~25 kernels and
    measured 3-4x slower on an H200), or one up to ALIGN_ONE_PROGRAM_PAIRS pairs; pairs of one
    slot may come in any order."""
    num_pairs = slot_of.numel()
    num_tiles = max_tiles(num_pairs, num_slots, block_m)
    device = slot_of.device
    one_program = num_pairs <= ALIGN_ONE_PROGRAM_PAIRS and num_slots <= ALIGN_ONE_PROGRAM_SLOTS
    # one program zeroes its counts itself
    counts = (torch.empty if one_program and num_pairs else torch.zeros)(num_slots, dtype=torch.int32, device=device)
    rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
    padded_start = torch.empty(num_slots, dtype=torch.int32, device=device)
    row_pair = torch.empty(num_tiles * block_m, dtype=torch.int32, device=device)  # every row written
    tile_slot = torch.empty(num_tiles, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return AlignedPairs(row_pair, tile_slot, counts)
    slot_of = slot_of.contiguous()
    if one_program:
        block_s = triton.next_power_of_2(num_slots)
        # A tile block holds [BLOCK_T, BLOCK_S] and [BLOCK_T, BLOCK_M] values: few slots must not
        # make the second huge (4096 x 128 at 2 slots took the GPU build past minutes).
        block_t = max(16, min(8192 // block_s, 8192 // block_m))
        _jit(_align_one_kernel, "num_pairs", "num_tiles")[(1,)](
            slot_of, counts, padded_start, row_pair, tile_slot, num_pairs, num_slots, num_tiles,
            BLOCK_M=block_m, BLOCK_P=ALIGN_ONE_PROGRAM_PAIRS, BLOCK_S=block_s, BLOCK_T=block_t,
            num_warps=4, **pdl_launch(slot_of))
        return AlignedPairs(row_pair, tile_slot, counts)
    block_p, block_t, block_s = 1024, 64, 128
    _jit(_count_kernel, "num_pairs")[(triton.cdiv(num_pairs, block_p),)](
        slot_of, counts, rank, num_pairs, BLOCK=block_p, **pdl_launch(slot_of))
    _jit(_offsets_kernel)[(1,)](counts, padded_start, num_slots, BLOCK_M=block_m, BLOCK_S=block_s, **pdl_launch(counts))
    grid = (max(triton.cdiv(num_pairs, block_p), triton.cdiv(num_tiles, block_t)),)
    _jit(_place_kernel, "num_pairs", "num_tiles")[grid](slot_of, rank, counts, padded_start, row_pair, tile_slot,
                              num_pairs, num_slots, num_tiles,
                              BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_T=block_t, BLOCK_S=block_s, **pdl_launch(slot_of))
    return AlignedPairs(row_pair, tile_slot, counts)


def align_pairs(slot_of: torch.Tensor, num_slots: int, block_m: int) -> AlignedPairs:
    """Pairs grouped by slot, each slot's rows padded to whole tiles of block_m rows."""
    if triton is not None and triton_ok(slot_of):
        return align_pairs_triton(slot_of, num_slots, block_m)
    return align_pairs_reference(slot_of, num_slots, block_m)
