"""The indexer's scoring launch for prompt rows: a program scores a tile of positions for a group
of consecutive rows at once, where the scoring launch of wideep_kernels/index_score.py scores it
for one row.

A prompt chunk's rows are its tokens, many to a sequence, and each scores the same keys of its
sequence up to its own position. Row by row, every row reads a tile's keys on its own and
multiplies them with its heads alone (an MMA a few heads wide, padded to 16); a 1024-token
chunk at a 32K context read each key 1024 times, and its scoring took 0.47 ms a layer on an H100
(bench.prefill_long; RESULTS, forty-first session). Here a program loads a tile's keys once for
ROWS rows and multiplies them with all ROWS x heads query columns in one MMA, then sums each
row's heads: that chunk's scoring took 0.20 ms, its scores and top-k 1.10 ms against 1.66.

A group is up to ROWS consecutive rows of one sequence (prompt_row_groups, once a step). A step
may mix decoding sequences with prompt chunks; a decoding sequence's one row is a group of its
own, multiplied with its own heads alone as the row-by-row launch does, and it gets as many
programs as a chunk's group. Two earlier forms were slower than row by row in such steps. One
took fixed groups of 16 rows and all of a group's columns for each of its sequences in turn: 64
decoding rows beside a 1,024-row chunk at 32K scored in 1.04 ms, against 0.76 (now 0.31). The
other multiplied each lone row with its own heads, but still 16 of them to a program, one after
another: the same step with FP8 keys at 100K took 3.49 ms for scores and top-k, against 3.19
(now 2.45). The formula, the -inf past each row's g_len, the workspace zeroing and the strided
group maxima are those of _score_tile_kernel.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # a CPU-only install without triton: wideep_kernels/indexer.py uses its reference
    triton = None
    tl = None

# Query columns (rows x heads) a program multiplies at once: the MMA's width.
COLUMNS = 128


def rows_per_group(num_heads: int) -> int:
    """Rows a program scores together for `num_heads` indexer heads (0: the row-by-row launch
    serves as well, the heads alone fill the MMA)."""
    heads = 1 << max(0, (num_heads - 1).bit_length())
    rows = COLUMNS // heads
    return rows if rows >= 2 else 0


class RowGroups(NamedTuple):
    """Prompt rows in groups of up to `rows` consecutive rows of one sequence."""

    first: torch.Tensor  # [G] int64: each group's first row
    count: torch.Tensor  # [G] int32: its rows; 0 for the spare groups past the step's last
    rows: int


def prompt_row_groups(row_seqs: torch.Tensor, num_heads: int, max_runs: int,
                      rows: int | None = None) -> RowGroups | None:
    """The groups of a step's rows (row_seqs [T]: each row's sequence, a sequence's rows
    consecutive; at most max_runs runs of one sequence), on the device without a sync, so that a
    CUDA graph can take it: cdiv(T, rows) + min(T, max_runs) groups, the spare ones empty. None
    where the heads alone fill the MMA (rows_per_group). `rows` overrides the rows a group."""
    rows = rows or rows_per_group(num_heads)
    if not rows:
        return None
    rows = max(rows, 16 // (1 << max(0, (num_heads - 1).bit_length())))  # tl.dot wants 16 columns
    total = row_seqs.shape[0]
    dev = row_seqs.device
    idx = torch.arange(total, device=dev)
    new_run = torch.ones(total, dtype=torch.bool, device=dev)
    new_run[1:] = row_seqs[1:] != row_seqs[:-1]
    run_start = torch.cummax(torch.where(new_run, idx, 0), dim=0).values
    starts = (idx - run_start) % rows == 0
    group_of = torch.cumsum(starts, dim=0) - 1
    groups = -(-total // rows) + min(total, max_runs)
    # the spare slot `groups` takes the rows that start no group
    first = torch.zeros(groups + 1, dtype=torch.int64, device=dev)
    first.scatter_(0, torch.where(starts, group_of, groups), idx)
    count = torch.zeros(groups + 1, dtype=torch.int32, device=dev)
    count.scatter_add_(0, group_of, torch.ones(total, dtype=torch.int32, device=dev))
    return RowGroups(first[:groups], count[:groups], rows)


if triton is not None:
    from .row_select import _key_to_score, _order_key

    @triton.jit
    def _tile_keys(keys_ptr, scale_ptr, row_table_ptr, stride_tm, stride_ks, stride_kd, block_size, g_len, pos, d,
                   d_ok, SCALED: tl.constexpr):
        """The keys [TILE, DIM] of positions `pos` of a row (zero past g_len) and their scales
        (SCALED)."""
        live = pos < g_len
        # Past g_len the table may be garbage: the masked load never reads it.
        block = tl.load(row_table_ptr + (pos // block_size) * stride_tm, mask=live, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        # One load of the tile's keys serves every head.
        keys = tl.load(keys_ptr + slot[:, None] * stride_ks + d[None, :] * stride_kd,
                       mask=live[:, None] & d_ok[None, :], other=0.0)
        scale = 1.0
        if SCALED:
            scale = tl.load(scale_ptr + slot, mask=live, other=1.0)
        return keys, scale

    @triton.jit
    def _operand(keys, q, UPCAST: tl.constexpr, F16: tl.constexpr, SCALED: tl.constexpr):
        """A tile's keys in the type they meet the query in."""
        if UPCAST:
            keys = keys.to(tl.float32)
        elif F16:
            keys = keys.to(tl.float16)
        elif SCALED:  # E4M3 values are exact in q's 16-bit type
            keys = keys.to(q.dtype)
        return keys

    @triton.jit(do_not_specialize=["stride_tb", "tiles"])
    def _score_rows_kernel(q_ptr, w_ptr, keys_ptr, scale_ptr, table_ptr, lens_ptr, first_ptr, count_ptr, out_ptr,
                           m_ptr, stride_qb, stride_qh, stride_qd, stride_wb, stride_wh,
                           stride_ks, stride_kd, stride_tb, stride_tm, stride_ob, stride_mb,
                           num_heads, head_dim, width, block_size, w_scale, zero_ptr, zero_per_row, tiles,
                           ROWS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                           ZERO: tl.constexpr, SKIP_DEAD: tl.constexpr, F16: tl.constexpr,
                           MAXIMA: tl.constexpr, NARROW_HEADS: tl.constexpr, PDL: tl.constexpr = 0):
        """Program (group, p) scores tiles p, p + P, ... (`tiles` of them) of the group's rows
        first_ptr[group] .. + count_ptr[group] - 1 (0 rows: a spare group, nothing to do)."""
        pdl_enter(PDL)
        n = tl.load(count_ptr + tl.program_id(0))
        if n == 0:
            return
        first = tl.load(first_ptr + tl.program_id(0))
        lane_r = tl.arange(0, ROWS)
        rows = first + lane_r
        row_ok = lane_r < n
        if ZERO:  # the selection's workspace for the group's rows, shared among its programs
            total = n * zero_per_row
            share = tl.cdiv(total, tl.num_programs(1))
            begin = tl.program_id(1) * share
            for i in range(0, share, 256):
                idx = begin + i + tl.arange(0, 256)
                tl.store(zero_ptr + first.to(tl.int64) * zero_per_row + idx, tl.zeros([256], dtype=tl.int32),
                         mask=(idx < begin + share) & (idx < total))
        g_len = tl.load(lens_ptr + rows, mask=row_ok, other=0)
        group_len = tl.max(g_len, axis=0)
        d = tl.arange(0, DIM)
        d_ok = d < head_dim
        # Query columns: column c is row c // HEADS's head c % HEADS.
        c = tl.arange(0, ROWS * HEADS)
        c_row, c_head = first + c // HEADS, c % HEADS
        c_ok = (c // HEADS < n) & (c_head < num_heads)
        q = tl.load(q_ptr + c_row[None, :].to(tl.int64) * stride_qb + c_head[None, :] * stride_qh
                    + d[:, None] * stride_qd, mask=d_ok[:, None] & c_ok[None, :], other=0.0)
        q_exp = tl.zeros([ROWS * HEADS], dtype=tl.float32)
        if UPCAST:
            q = q.to(tl.float32)
        elif F16:  # each row's query scaled by its own power of two, as _score_tile_kernel does
            qf = q.to(tl.float32)
            row_max = tl.max(tl.reshape(tl.max(tl.abs(qf), axis=0), [ROWS, HEADS]), axis=1)
            row_exp = tl.maximum(tl.ceil(tl.log2(row_max)) - 14.0, 0.0)
            q_exp = tl.reshape(tl.broadcast_to(row_exp[:, None], [ROWS, HEADS]), [ROWS * HEADS])
            q = (qf * tl.exp2(-q_exp)[None, :]).to(tl.float16)
        wt = tl.load(w_ptr + c_row.to(tl.int64) * stride_wb + c_head * stride_wh, mask=c_ok,
                     other=0.0).to(tl.float32) * w_scale
        # A lone row's query with its heads alone (padded to NARROW_HEADS >= 16 for the MMA).
        h1 = tl.arange(0, NARROW_HEADS)
        h1_ok = h1 < num_heads
        q1 = tl.load(q_ptr + first.to(tl.int64) * stride_qb + d[:, None] * stride_qd + h1[None, :] * stride_qh,
                     mask=d_ok[:, None] & h1_ok[None, :], other=0.0)
        q1_exp = 0.0
        if UPCAST:
            q1 = q1.to(tl.float32)
        elif F16:
            q1f = q1.to(tl.float32)
            q1_exp = tl.maximum(tl.ceil(tl.log2(tl.max(tl.max(tl.abs(q1f), axis=1), axis=0))) - 14.0, 0.0)
            q1 = (q1f * tl.exp2(-q1_exp)).to(tl.float16)
        wt1 = tl.load(w_ptr + first.to(tl.int64) * stride_wb + h1 * stride_wh, mask=h1_ok,
                      other=0.0).to(tl.float32) * w_scale
        lane = tl.arange(0, TILE)
        best = tl.zeros([ROWS, TILE], dtype=tl.uint32)
        out_rows = out_ptr + rows[:, None].to(tl.int64) * stride_ob
        row_table = table_ptr + first.to(tl.int64) * stride_tb  # the group's sequence's block table
        # The program's tiles are p, p + P, ...: the first `live` of them reach a row of the group,
        # the rest lie wholly past it. Loops without a branch inside can be software-pipelined
        # (the next tiles' keys loaded while this one is multiplied, num_stages).
        live = tl.minimum(tl.maximum(tl.cdiv(tl.cdiv(group_len, TILE) - tl.program_id(1), tl.num_programs(1)), 0),
                          tiles)
        if n == 1:
            for i in range(live):
                pos = (tl.program_id(1) + i * tl.num_programs(1)) * TILE + lane
                keys, scale = _tile_keys(keys_ptr, scale_ptr, row_table, stride_tm, stride_ks, stride_kd, block_size,
                                         group_len, pos, d, d_ok, SCALED)
                keys = _operand(keys, q1, UPCAST, F16, SCALED)
                dots1 = tl.dot(keys, q1, input_precision=PRECISION)  # [TILE, NARROW_HEADS] fp32
                if F16:
                    dots1 = dots1 * tl.exp2(q1_exp)
                score1 = tl.sum(tl.maximum(dots1, 0.0) * wt1[None, :], axis=1)
                if SCALED:  # relu(q . (s k)) = s relu(q . k) for the positive per-key scale s
                    score1 = score1 * scale
                score1 = tl.where(pos < group_len, score1, float("-inf"))
                tl.store(out_ptr + first.to(tl.int64) * stride_ob + pos, score1, mask=pos < width)
                if MAXIMA:
                    best = tl.where((lane_r == 0)[:, None], tl.maximum(best, _order_key(score1)[None, :]), best)
        else:
            for i in range(live):
                pos = (tl.program_id(1) + i * tl.num_programs(1)) * TILE + lane
                keys, scale = _tile_keys(keys_ptr, scale_ptr, row_table, stride_tm, stride_ks, stride_kd, block_size,
                                         group_len, pos, d, d_ok, SCALED)
                keys = _operand(keys, q, UPCAST, F16, SCALED)
                dots = tl.dot(keys, q, input_precision=PRECISION)  # [TILE, ROWS * HEADS] fp32
                if F16:
                    dots = dots * tl.exp2(q_exp)[None, :]
                score = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * wt[None, :], [TILE, ROWS, HEADS]), axis=2)
                score = tl.trans(score)  # [ROWS, TILE]
                if SCALED:
                    score = score * scale[None, :]
                score = tl.where(pos[None, :] < g_len[:, None], score, float("-inf"))
                tl.store(out_rows + pos[None, :], score, mask=row_ok[:, None] & (pos[None, :] < width))
                if MAXIMA:
                    best = tl.maximum(best, _order_key(score))
        if not SKIP_DEAD:  # tiles no row of the group reaches: -inf, nothing to score
            dead = tl.full([ROWS, TILE], float("-inf"), tl.float32)
            for i in range(live, tiles):
                pos = (tl.program_id(1) + i * tl.num_programs(1)) * TILE + lane
                tl.store(out_rows + pos[None, :], dead, mask=row_ok[:, None] & (pos[None, :] < width))
            if MAXIMA and live < tiles:
                best = tl.maximum(best, _order_key(dead))
        if MAXIMA:
            tl.store(m_ptr + rows[:, None].to(tl.int64) * stride_mb + tl.program_id(1) * TILE + lane[None, :],
                     _key_to_score(best), mask=row_ok[:, None])


# Programs of a launch without the group maxima, about (each scores several tiles), and each
# program's positions and warps.
ROWS_PROGRAMS = 2048
ROWS_TILE = 64
ROWS_WARPS = 4
# Software-pipeline stages of the live tiles' loop (the next tiles' keys copied while one is
# multiplied). 1 builds it as before the loop could be pipelined; more are not yet timed on a GPU
# (bench.probe_score_rows --choices 64:4:3; WIDEEP_SCORE_ROWS_STAGES for the engine).
ROWS_STAGES = int(os.environ.get("WIDEEP_SCORE_ROWS_STAGES", "1"))


def score_rows_launch(q, w, index_keys, block_tables, g_lens, groups: RowGroups, block_size, out, *, tile,
                      num_warps, key_scale, w_scale, zero, skip_dead, f16, upcast, fp32, maxima):
    """Fill out [T, width] as _score_launch does, a group of rows (prompt_row_groups) a program."""
    num_rows, num_heads, head_dim = q.shape
    width = out.shape[1]
    heads = 1 << max(0, (num_heads - 1).bit_length())
    dim = max(16, 1 << max(0, (head_dim - 1).bit_length()))
    if groups.rows * heads < 16:
        raise ValueError(f"{groups.rows} rows of {heads} heads: tl.dot wants 16 columns (prompt_row_groups)")
    row_tiles = triton.cdiv(width, tile)
    if maxima is not None:
        programs = maxima.shape[1] // tile
    else:  # as many programs for a decoding row's group as for a chunk's
        programs = min(row_tiles, max(1, triton.cdiv(ROWS_PROGRAMS, triton.cdiv(num_rows, groups.rows))))
    tiles = triton.cdiv(row_tiles, programs)
    scale = key_scale.float().contiguous() if key_scale is not None else out
    _score_rows_kernel[(groups.first.shape[0], programs)](
        q, w, index_keys, scale, block_tables, g_lens, groups.first, groups.count, out,
        maxima if maxima is not None else out,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
        index_keys.stride(0), index_keys.stride(1), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), maxima.stride(0) if maxima is not None else 0,
        num_heads, head_dim, width, block_size, float(w_scale), zero if zero is not None else g_lens,
        zero.numel() // num_rows if zero is not None else 0, tiles,
        ROWS=groups.rows, HEADS=heads, DIM=dim, TILE=tile, PRECISION="ieee" if fp32 else "tf32", UPCAST=upcast,
        SCALED=key_scale is not None, ZERO=zero is not None, SKIP_DEAD=skip_dead, F16=f16,
        MAXIMA=maxima is not None, NARROW_HEADS=max(16, heads), num_warps=num_warps, num_stages=ROWS_STAGES,
        **pdl_launch(q))
    return out
