"""The indexer's scoring launch for prompt rows: a program scores a tile of positions for a group
of consecutive rows at once, where the scoring launch of wideep_kernels/index_score.py scores it
for one row.

A prompt chunk's rows are its tokens, many to a sequence, and each scores the same keys of its
sequence up to its own position. Row by row, every row reads a tile's keys on its own and
multiplies them with its heads alone (an MMA a few heads wide, padded to 16); a 1024-token
chunk at a 32K context read each key 1024 times, and its scoring took 0.47 ms a layer on an H100
(bench.prefill_long; RESULTS, forty-first session). Here a program loads a tile's keys once for
ROWS rows and multiplies them with all ROWS x heads query columns in one MMA, then sums each
row's heads.

The rows of a group need not share a sequence (a step may mix decoding sequences with prompt
chunks): the program takes the group's sequences one after another (rows of a sequence are
consecutive), loading each one's keys through its own block table and keeping the scores of its
rows alone. A sequence with one row in the group (a decoding one) is multiplied with its own
heads alone, as the row-by-row launch does: with all of the group's columns, a step of 64
decoding rows beside a 1,024-row chunk at 32K scored in 1.04 ms against 0.76 row by row (H100). The formula, the -inf past each row's g_len, the workspace zeroing and the strided
group maxima are those of _score_tile_kernel.
"""
from __future__ import annotations

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


if triton is not None:
    from .row_select import _key_to_score, _order_key

    @triton.jit
    def _one_row(keys, q_ptr, w_ptr, row, stride_qb, stride_qh, stride_qd, stride_wb, stride_wh, num_heads,
                 w_scale, d, d_ok, HEADS: tl.constexpr, UPCAST: tl.constexpr, F16: tl.constexpr,
                 PRECISION: tl.constexpr):
        """One row's scores of a key tile [TILE, DIM], as _score_tile_kernel computes them (its heads
        padded to HEADS >= 16 with zero weight); the per-key scale and g_len are the caller's."""
        h = tl.arange(0, HEADS)
        h_ok = h < num_heads
        q = tl.load(q_ptr + row.to(tl.int64) * stride_qb + d[:, None] * stride_qd + h[None, :] * stride_qh,
                    mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        q_exp = 0.0
        if UPCAST:
            q = q.to(tl.float32)
        elif F16:
            qf = q.to(tl.float32)
            q_exp = tl.maximum(tl.ceil(tl.log2(tl.max(tl.max(tl.abs(qf), axis=1), axis=0))) - 14.0, 0.0)
            q = (qf * tl.exp2(-q_exp)).to(tl.float16)
        wt = tl.load(w_ptr + row.to(tl.int64) * stride_wb + h * stride_wh, mask=h_ok, other=0.0).to(tl.float32)
        dots = tl.dot(keys, q, input_precision=PRECISION)
        if F16:
            dots = dots * tl.exp2(q_exp)
        return tl.sum(tl.maximum(dots, 0.0) * (wt * w_scale)[None, :], axis=1)

    @triton.jit(do_not_specialize=["stride_tb", "tiles", "num_rows"])
    def _score_rows_kernel(q_ptr, w_ptr, keys_ptr, scale_ptr, table_ptr, lens_ptr, seq_ptr, out_ptr, m_ptr,
                           stride_qb, stride_qh, stride_qd, stride_wb, stride_wh,
                           stride_ks, stride_kd, stride_tb, stride_tm, stride_ob, stride_mb,
                           num_rows, num_heads, head_dim, width, block_size, w_scale, zero_ptr, zero_per_row, tiles,
                           ROWS: tl.constexpr, HEADS: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                           ZERO: tl.constexpr, SKIP_DEAD: tl.constexpr, F16: tl.constexpr,
                           MAXIMA: tl.constexpr, NARROW_HEADS: tl.constexpr, PDL: tl.constexpr = 0):
        """Program (group, p) scores tiles p, p + P, ... (`tiles` of them) of rows group * ROWS ..
        group * ROWS + ROWS - 1. seq_ptr: each row's sequence (rows of one are consecutive)."""
        pdl_enter(PDL)
        first = tl.program_id(0) * ROWS
        rows = first + tl.arange(0, ROWS)
        row_ok = rows < num_rows
        group_rows = tl.minimum(num_rows - first, ROWS)
        if ZERO:  # the selection's workspace for the group's rows, shared among its programs
            total = group_rows * zero_per_row
            share = tl.cdiv(total, tl.num_programs(1))
            begin = tl.program_id(1) * share
            for i in range(0, share, 256):
                idx = begin + i + tl.arange(0, 256)
                tl.store(zero_ptr + first * zero_per_row + idx, tl.zeros([256], dtype=tl.int32),
                         mask=(idx < begin + share) & (idx < total))
        g_len = tl.load(lens_ptr + rows, mask=row_ok, other=0)
        seq = tl.load(seq_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        # (a sequence's rows are consecutive, so most groups are one run; any order is scored right)
        group_len = tl.max(g_len, axis=0)
        # Query columns: column c is row c // HEADS's head c % HEADS.
        c = tl.arange(0, ROWS * HEADS)
        c_row, c_head = first + c // HEADS, c % HEADS
        c_ok = (c_row < num_rows) & (c_head < num_heads)
        d = tl.arange(0, DIM)
        d_ok = d < head_dim
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
        lane = tl.arange(0, TILE)
        best = tl.zeros([ROWS, TILE], dtype=tl.uint32)
        out_rows = out_ptr + rows[:, None].to(tl.int64) * stride_ob
        for i in range(tiles):
            pos = (tl.program_id(1) + i * tl.num_programs(1)) * TILE + lane
            start = (tl.program_id(1) + i * tl.num_programs(1)) * TILE
            if start < group_len:
                done = 0
                while done < group_rows:  # the group's runs of one sequence, in turn
                    lead = first + done
                    lead_seq = tl.load(seq_ptr + lead).to(tl.int64)
                    # the run: rows from lead on up to the first of another sequence
                    after = tl.min(tl.where((rows > lead) & (seq != lead_seq) & row_ok, rows - first, ROWS), axis=0)
                    run_end = tl.minimum(after, group_rows)
                    own = (rows >= lead) & (rows < first + run_end)
                    own_len = tl.max(tl.where(own, g_len, 0), axis=0)
                    live = pos < own_len
                    # Past own_len the table may be garbage: the masked load never reads it.
                    block = tl.load(table_ptr + lead.to(tl.int64) * stride_tb + (pos // block_size) * stride_tm,
                                    mask=live, other=0)
                    slot = block.to(tl.int64) * block_size + pos % block_size
                    keys = tl.load(keys_ptr + slot[:, None] * stride_ks + d[None, :] * stride_kd,
                                   mask=live[:, None] & d_ok[None, :], other=0.0)
                    if UPCAST:
                        keys = keys.to(tl.float32)
                    elif F16:
                        keys = keys.to(tl.float16)
                    elif SCALED:  # E4M3 values are exact in q's 16-bit type
                        keys = keys.to(q.dtype)
                    if run_end - done == 1:  # a lone row (a decoding sequence's): its own heads alone
                        score1 = _one_row(keys, q_ptr, w_ptr, lead, stride_qb, stride_qh, stride_qd, stride_wb,
                                          stride_wh, num_heads, w_scale, d, d_ok, NARROW_HEADS, UPCAST, F16,
                                          PRECISION)
                        if SCALED:
                            score1 = score1 * tl.load(scale_ptr + slot, mask=live, other=1.0)
                        score1 = tl.where(live, score1, float("-inf"))
                        tl.store(out_ptr + lead.to(tl.int64) * stride_ob + pos, score1, mask=pos < width)
                        if MAXIMA:
                            best = tl.where((rows == lead)[:, None], tl.maximum(best, _order_key(score1)[None, :]),
                                            best)
                    else:
                        dots = tl.dot(keys, q, input_precision=PRECISION)  # [TILE, ROWS * HEADS] fp32
                        if F16:
                            dots = dots * tl.exp2(q_exp)[None, :]
                        score = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * wt[None, :], [TILE, ROWS, HEADS]),
                                       axis=2)
                        score = tl.trans(score)  # [ROWS, TILE]
                        if SCALED:  # relu(q . (s k)) = s relu(q . k) for the positive per-key scale s
                            score = score * tl.load(scale_ptr + slot, mask=live, other=1.0)[None, :]
                        score = tl.where(pos[None, :] < g_len[:, None], score, float("-inf"))
                        tl.store(out_rows + pos[None, :], score, mask=own[:, None] & (pos[None, :] < width))
                        if MAXIMA:
                            best = tl.where(own[:, None], tl.maximum(best, _order_key(score)), best)
                    done = run_end
            else:
                if not SKIP_DEAD:  # no row of the group reaches this tile: -inf, nothing to score
                    dead = tl.full([ROWS, TILE], float("-inf"), tl.float32)
                    tl.store(out_rows + pos[None, :], dead, mask=row_ok[:, None] & (pos[None, :] < width))
                    if MAXIMA:
                        best = tl.maximum(best, _order_key(dead))
        if MAXIMA:
            tl.store(m_ptr + rows[:, None].to(tl.int64) * stride_mb + tl.program_id(1) * TILE + lane[None, :],
                     _key_to_score(best), mask=row_ok[:, None])


# Programs of a launch without the group maxima, about (each scores several tiles), and each
# program's positions and warps.
ROWS_PROGRAMS = 2048
ROWS_TILE = 64
ROWS_WARPS = 4


def score_rows_launch(q, w, index_keys, block_tables, g_lens, row_seqs, block_size, out, *, tile, num_warps,
                      key_scale, w_scale, zero, skip_dead, f16, upcast, fp32, maxima, rows):
    """Fill out [T, width] as _score_launch does, `rows` rows a program (rows_per_group).
    row_seqs [T]: each row's sequence, rows of one consecutive."""
    num_rows, num_heads, head_dim = q.shape
    width = out.shape[1]
    heads = 1 << max(0, (num_heads - 1).bit_length())
    dim = max(16, 1 << max(0, (head_dim - 1).bit_length()))
    if rows * heads < 16:  # tl.dot wants every dimension >= 16
        rows = 16 // heads
    groups = triton.cdiv(num_rows, rows)
    row_tiles = triton.cdiv(width, tile)
    if maxima is not None:
        programs = maxima.shape[1] // tile
    else:
        programs = min(row_tiles, max(1, triton.cdiv(ROWS_PROGRAMS, groups)))
    tiles = triton.cdiv(row_tiles, programs)
    scale = key_scale.float().contiguous() if key_scale is not None else out
    _score_rows_kernel[(groups, programs)](
        q, w, index_keys, scale, block_tables, g_lens, row_seqs, out, maxima if maxima is not None else out,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
        index_keys.stride(0), index_keys.stride(1), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), maxima.stride(0) if maxima is not None else 0,
        num_rows, num_heads, head_dim, width, block_size, float(w_scale), zero if zero is not None else g_lens,
        zero.numel() // num_rows if zero is not None else 0, tiles,
        ROWS=rows, HEADS=heads, DIM=dim, TILE=tile, PRECISION="ieee" if fp32 else "tf32", UPCAST=upcast,
        SCALED=key_scale is not None, ZERO=zero is not None, SKIP_DEAD=skip_dead, F16=f16,
        MAXIMA=maxima is not None, NARROW_HEADS=max(16, heads), num_warps=num_warps, **pdl_launch(q))
    return out
