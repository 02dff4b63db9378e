"""The indexer's scoring launch: each decoding sequence's score of every cached position (the
formula in wideep_kernels/indexer.py), read through the paged block table, with bf16 or FP8 (E4M3 with
per-key scales) index keys. A program scores one tile of a row or, P programs a row, the row's
tiles p, p + P, ...; for the threshold select it also writes the rows' strided group maxima.
The selection that follows is wideep_kernels/indexer.py's.
"""
from __future__ import annotations

import os

import torch

from .index_score_rows import ROWS_TILE, ROWS_WARPS, RowGroups, _operand, _tile_keys, score_rows_launch
from .tuning import tuned_config

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # a CPU-only install without triton: wideep_kernels/indexer.py uses its reference
    triton = None
    tl = None


if triton is not None:
    from .row_select import _key_to_score, _order_key

    # Integer arguments that are 1 or a multiple of 16 get their own build unless listed in
    # do_not_specialize; block-table widths and tile counts change as contexts grow, so they
    # are listed (they only index scalars) and a longer context never stalls decode on a build.
    # Widths and row strides keep the specialisation: it lets the score loads and stores vectorise.
    @triton.jit
    def _score_store(keys, scale, q, q_exp, wt, row_out_ptr, pos, g_len, width, best, UPCAST: tl.constexpr,
                     F16: tl.constexpr, SCALED: tl.constexpr, MAXIMA: tl.constexpr, PRECISION: tl.constexpr):
        """Score one tile (-inf past g_len) and store it; returns `best` with the tile's order keys
        maxed in (MAXIMA)."""
        keys = _operand(keys, q, UPCAST, F16, SCALED)
        dots = tl.dot(keys, q, input_precision=PRECISION)  # [TILE, HEADS] fp32
        if F16:
            dots = dots * tl.exp2(q_exp)
        score = tl.sum(tl.maximum(dots, 0.0) * wt[None, :], axis=1)
        if SCALED:  # relu(q . (s k)) = s relu(q . k) for the positive per-key scale s
            score = score * scale
        score = tl.where(pos < g_len, score, float("-inf"))
        tl.store(row_out_ptr + pos, score, mask=pos < width)
        if MAXIMA:
            best = tl.maximum(best, _order_key(score))
        return best

    @triton.jit(do_not_specialize=["stride_tb", "tiles"])
    def _score_tile_kernel(q_ptr, w_ptr, keys_ptr, scale_ptr, table_ptr, lens_ptr, out_ptr, m_ptr,
                           stride_qb, stride_qh, stride_qd, stride_wb, stride_wh,
                           stride_ks, stride_kd, stride_tb, stride_tm, stride_ob, stride_mb,
                           num_heads, head_dim, width, block_size, w_scale, zero_ptr, zero_per_row, tiles,
                           HEADS: tl.constexpr, DIM: tl.constexpr, TILE: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                           ZERO: tl.constexpr, SKIP_DEAD: tl.constexpr, F16: tl.constexpr = False,
                           MAXIMA: tl.constexpr = False, LOOP: tl.constexpr = False, PDL: tl.constexpr = 0):
        """Program (seq, p) scores tiles p, p + P, p + 2 P, ... (`tiles` of them, P programs a row;
        LOOP set where `tiles` > 1).
        MAXIMA: it also writes m[seq, p * TILE + j], the largest score at positions
        p * TILE + j + i * P * TILE, which are the strided group maxima of wideep_kernels/wide_select.py
        for the group stride P * TILE (on the order keys, as _group_max_kernel takes them)."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        lane = tl.arange(0, TILE)
        if ZERO:  # the selection's zeroed workspace, cleared here instead of by a launch of its own:
            # the row's programs each clear a share of one row's worth (one program alone made
            # the launch 21 us a step longer at batch 64)
            share = tl.cdiv(zero_per_row, tl.num_programs(1))
            first = tl.program_id(1) * share
            for i in range(0, share, 256):
                idx = first + i + tl.arange(0, 256)
                tl.store(zero_ptr + seq * zero_per_row + idx, tl.zeros([256], dtype=tl.int32),
                         mask=(idx < first + share) & (idx < zero_per_row))
        g_len = tl.load(lens_ptr + seq)
        if SKIP_DEAD:  # the one-launch select reads no score past g_len: a tile past it has no work
            if tl.program_id(1) * TILE >= g_len:
                return
        d = tl.arange(0, DIM)
        h = tl.arange(0, HEADS)
        d_ok = d < head_dim
        h_ok = h < num_heads
        # The first tile's keys are on their way before the query is: loads issued after the
        # query's scaling (a reduction across warps) would wait for it.
        pos = tl.program_id(1) * TILE + lane
        keys, scale = _tile_keys(keys_ptr, scale_ptr, table_ptr + seq * stride_tb, stride_tm, stride_ks, stride_kd,
                                 block_size, g_len, pos, d, d_ok, SCALED)
        # The query and head weights are loaded (and scaled) once for all of the program's tiles.
        q = tl.load(q_ptr + seq * stride_qb + d[:, None] * stride_qd + h[None, :] * stride_qh,
                    mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        q_exp = 0.0
        if UPCAST:
            q = q.to(tl.float32)
        elif F16:
            # E4M3 widens to fp16 in one instruction a pair (to bf16 it takes one more a key), and a
            # bf16 q is exact in fp16 once scaled by a power of two below fp16's largest value.
            qf = q.to(tl.float32)
            q_exp = tl.maximum(tl.ceil(tl.log2(tl.max(tl.max(tl.abs(qf), axis=1), axis=0))) - 14.0, 0.0)
            q = (qf * tl.exp2(-q_exp)).to(tl.float16)
        wt = tl.load(w_ptr + seq * stride_wb + h * stride_wh, mask=h_ok, other=0.0).to(tl.float32) * w_scale
        best = _score_store(keys, scale, q, q_exp, wt, out_ptr + seq * stride_ob, pos, g_len, width,
                            tl.zeros([TILE], dtype=tl.uint32), UPCAST, F16, SCALED, MAXIMA, PRECISION)
        if LOOP:  # a build of its own: the loop's registers would cost one-tile programs occupancy
            for _ in range(1, tiles):  # the program's later tiles, a row's P * TILE positions apart
                pos += tl.num_programs(1) * TILE
                keys, scale = _tile_keys(keys_ptr, scale_ptr, table_ptr + seq * stride_tb, stride_tm, stride_ks,
                                         stride_kd, block_size, g_len, pos, d, d_ok, SCALED)
                best = _score_store(keys, scale, q, q_exp, wt, out_ptr + seq * stride_ob, pos, g_len, width, best,
                                    UPCAST, F16, SCALED, MAXIMA, PRECISION)
        if MAXIMA:
            tl.store(m_ptr + seq * stride_mb + tl.program_id(1) * TILE + lane, _key_to_score(best))


def _next_pow2(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


# FP8 index keys with a bf16 query: score in fp16 (kernels above). On the H200 the batch-16 decode
# step with FP8 index keys took 8.85 / 8.83 ms at 512K with it against 9.67 / 9.63 without (8K:
# 2.91 against 2.94), where bf16 keys took 9.61; yet the scoring kernel timed alone
# (bench.probe_score) was 7% slower with it (220 against 206 us a layer, tile 128, 2 warps), one
# tile a program: each program scaled the query again, a reduction across warps that the fp16
# form alone has. With several tiles a program (FP8_SCORE_PROGRAMS) the scaling is paid once and
# the fp16 form takes 178.8 us (the bf16-widened form was not timed that way; RESULTS, fourteenth
# and fifteenth sessions). WIDEEP_FP8_SCORES_F16=0 widens FP8 keys to bf16 instead.
FP8_SCORES_IN_F16 = os.environ.get("WIDEEP_FP8_SCORES_F16", "1") != "0"


def score_tune_key(num_heads: int, head_dim: int, fp8: bool) -> str:
    """Shape key of the scoring kernel in wideep_kernels/tuned/<gpu>.json. The launch configuration
    does not follow the row width, so a context that grows never meets a new build."""
    return f"{'fp8' if fp8 else 'bf16'}|h{num_heads}|d{head_dim}"


# Programs of the scoring launch with the threshold select's group maxima (wideep_kernels/indexer.py
# SCORE_MAXIMA) have MAXIMA_WARPS warps. FP8 keys without the maxima: about FP8_SCORE_PROGRAMS
# programs, each scoring several tiles, rather than one a tile (bf16 keys keep one a tile). On
# the H200, batch 16 (bench.probe_score, us a layer at 128K / 512K): FP8 keys one tile a program
# 65.5 / 234.7 (tile 128, 2 warps), 16 tiles 48.8 / 178.8, with the maxima (64 programs a row)
# 49.9 / 180.1; bf16 keys one tile a program 69.6 / 267.0 (4 warps), with the maxima 73.5 / 279.1
# at 2 warps against 88.1 / 333.8 at 4. The program loads and scales the query once for all of
# its tiles. 1024 programs rather than 2048: batch 1 at 512K 13.6 against 15.3 us a layer, the
# decode step 1.709 against 1.776 ms; batch 4 and 16 within 1% (RESULTS, sixteenth session).
MAXIMA_WARPS = 2
FP8_SCORE_PROGRAMS = 1024


def _score_choice(q: torch.Tensor, scaled: bool) -> dict:
    """The scoring kernel's tile (positions) and num_warps for q [B, heads, dim]: this GPU's tuned
    ones (wideep_kernels/tuned/<gpu>.json), else 128 positions and 4 warps."""
    choice = dict(tile=128, num_warps=4)
    if q.dtype != torch.float32:
        tuned = tuned_config(q.device, "indexer_score", score_tune_key(q.shape[1], q.shape[2], scaled))
        choice.update({k: v for k, v in (tuned or {}).items() if k in choice})
    return choice


def _score_launch(q, w, index_keys, block_tables, g_lens, block_size,
                  tile: int | None = None, num_warps: int | None = None,
                  key_scale: torch.Tensor | None = None, w_scale: float = 1.0,
                  zero: torch.Tensor | None = None, skip_dead: bool = False,
                  f16: bool | None = None, maxima: torch.Tensor | None = None,
                  programs: int | None = None, num_stages: int | None = None,
                  row_groups: RowGroups | None = None) -> torch.Tensor:
    """[B, width] fp32 scores, -inf past each row's g_len; `zero` (int32, B rows' worth: the
    selection's workspace) is zeroed too. `skip_dead`: tiles wholly past g_len are not written
    (for the one-launch select, which never reads there). `maxima` [B, T] fp32 (T a multiple of
    the tile): also write each row's strided group maxima for group stride T
    (wideep_kernels/wide_select.py), T / tile programs a row. `programs`: programs a row otherwise
    (each scores every programs-th tile). Launch choices left out come from _score_choice.
    `row_groups`: where rows are prompt tokens (several to a sequence), their groups of one
    sequence, a group a program (wideep_kernels/index_score_rows.py prompt_row_groups)."""
    num_seqs, num_heads, head_dim = q.shape
    width = block_tables.shape[1] * block_size
    out = torch.empty(num_seqs, width, device=q.device, dtype=torch.float32)
    if maxima is not None and (maxima.shape[0] != num_seqs or maxima.stride(1) != 1):
        raise ValueError(f"maxima must be [{num_seqs}, T] with rows contiguous, got {tuple(maxima.shape)}")
    if num_seqs == 0 or width == 0:
        return out
    g_lens = g_lens.to(device=q.device, dtype=torch.int32).contiguous()
    # tl.dot wants every dimension >= 16; padded heads carry zero weight.
    heads = _next_pow2(num_heads, 16)
    dim = _next_pow2(head_dim, 16)
    probe = tile is not None or num_warps is not None  # a probe's choice: nothing built in mixed in
    grouped = row_groups is not None and not probe
    if grouped:
        tile, num_warps = ROWS_TILE, ROWS_WARPS
    elif not probe:
        tile, num_warps = _score_choice(q, key_scale is not None).values()
        if maxima is not None:
            num_warps = MAXIMA_WARPS
    tile = tile or 128
    num_warps = num_warps or 4
    row_tiles = triton.cdiv(width, tile)
    if maxima is not None:
        if maxima.shape[1] % tile:
            raise ValueError(f"the maxima's group stride {maxima.shape[1]} must be a multiple of the tile {tile}")
        programs = maxima.shape[1] // tile
    elif programs is None and key_scale is not None:  # (the tuner's choices are timed in this form too)
        programs = triton.cdiv(FP8_SCORE_PROGRAMS, num_seqs)
    programs = min(programs or row_tiles, row_tiles) if maxima is None else programs
    # Mixed dtypes meet in fp32. So do bf16 ones under the CPU interpreter, whose tl.dot
    # multiplies bf16 bit patterns as integers (seen with triton 3.9); bf16 products are
    # exact in fp32, so this only moves rounding of the sum, as the native path does.
    scaled = key_scale is not None
    # FP8 keys are widened to q's type in the kernel when q is 16-bit.
    upcast = (q.dtype != index_keys.dtype and not (scaled and q.dtype in (torch.bfloat16, torch.float16))
              or not q.is_cuda)
    f16 = bool(FP8_SCORES_IN_F16 if f16 is None else f16) and scaled and q.dtype == torch.bfloat16
    upcast = upcast and not f16  # fp16 operands are exact under the interpreter too (bf16 ones are not)
    # fp32 operands must not be rounded to tf32, or near-equal scores would swap places.
    fp32 = upcast or q.dtype == torch.float32
    if grouped:
        return score_rows_launch(q, w, index_keys, block_tables, g_lens, row_groups, block_size, out,
                                 tile=tile, num_warps=num_warps, key_scale=key_scale, w_scale=w_scale,
                                 zero=zero, skip_dead=skip_dead, f16=f16, upcast=upcast, fp32=fp32, maxima=maxima)
    tiles = triton.cdiv(row_tiles, programs)
    grid = (num_seqs, programs)
    scale = key_scale.float().contiguous() if scaled else out  # any pointer when unused
    _score_tile_kernel[grid](
        q, w, index_keys, scale, block_tables, g_lens, out, maxima if maxima is not None else out,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
        index_keys.stride(0), index_keys.stride(1), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), maxima.stride(0) if maxima is not None else 0,
        num_heads, head_dim, width, block_size, float(w_scale), zero if zero is not None else g_lens,
        zero.numel() // num_seqs if zero is not None else 0, tiles,
        HEADS=heads, DIM=dim, TILE=tile, PRECISION="ieee" if fp32 else "tf32", UPCAST=upcast, SCALED=scaled,
        ZERO=zero is not None, SKIP_DEAD=skip_dead, F16=f16, MAXIMA=maxima is not None, LOOP=tiles > 1,
        num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}), **pdl_launch(q))
    return out


def indexer_scores_triton(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                          block_tables: torch.Tensor, g_lens: torch.Tensor,
                          block_size: int, key_scale: torch.Tensor | None = None,
                          w_scale: float = 1.0) -> torch.Tensor:
    """Triton form of indexer_scores_reference (same shape and -inf padding)."""
    return _score_launch(q, w, index_keys, block_tables, g_lens, block_size, key_scale=key_scale, w_scale=w_scale)
