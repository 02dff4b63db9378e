"""The indexer's scoring launch for FP8 index keys (kernels/index_score.py) written in Gluon for
Hopper: the same arguments, the same scores, maxima and zeroed workspace.

Why: the Triton kernel holds a tile's keys in registers between their load and the product, so
each program has one tile in flight (a second costs the 2-warp programs their occupancy: RESULTS,
eighteenth session), and at 512K it reads at about half the copy bandwidth. Here a program copies
its tiles (cp.async) into a ring of NBUF shared-memory buffers, NBUF - 1 tiles ahead of the
products, with each tile's block-table entries loaded one tile before its copies. The products are
Ampere-style MMAs on fp16 operands: E4M3 keys widen to fp16 exactly, and the query is scaled by a
power of two into fp16's range, as the Triton kernel's fp16 form does (index_score.py
FP8_SCORES_IN_F16).

Limits (the dispatcher uses it only there): a bf16 query, E4M3 keys with fp32 scales, at most 16
heads, a power-of-two head dim of 16-256, key rows starting on 16 bytes, sm_90.
"""
from __future__ import annotations

import functools
import os

import torch

from kernels import _unusable
from kernels.fp8_kv import FP8_DTYPE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    from kernels.pdl import gdc_launch_dependents, gdc_wait
except Exception:  # a Triton without Gluon, or without its Ampere ops
    gluon = None

# WIDEEP_SCORE_GLUON=0 keeps the Triton kernel for FP8 keys everywhere.
ENABLED = os.environ.get("WIDEEP_SCORE_GLUON", "1") != "0"
HEADS = 16  # the products' column block (an MMA wants at least 8; heads past num_heads weigh 0)


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def gluon_scoring_applies(q: torch.Tensor, index_keys: torch.Tensor, key_scale) -> bool:
    """Whether the FP8 scoring launch takes the Gluon kernel for these inputs (module docstring)."""
    if not ENABLED or gluon is None or not q.is_cuda or "index_score_gluon" in _unusable:
        return False
    dim = q.shape[2]
    return (key_scale is not None and index_keys.dtype == FP8_DTYPE and q.dtype == torch.bfloat16
            and q.shape[1] <= HEADS and 16 <= dim <= 256 and not (dim & (dim - 1))
            and index_keys.shape[1] == dim and index_keys.stride(1) == 1 and index_keys.stride(0) % 16 == 0
            and index_keys.data_ptr() % 16 == 0
            and _is_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()))


if gluon is not None:

    @gluon.jit
    def _order_key(s):
        """As kernels/row_select.py's: fp32 -> uint32 in float order, -0.0 taking 0.0's key."""
        bits = gl.where(s == 0.0, 0.0, s).to(gl.uint32, bitcast=True)
        return gl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)

    @gluon.jit
    def _key_to_score(key):
        bits = gl.where((key >> 31) != 0, key ^ 0x80000000, ~key)
        return bits.to(gl.float32, bitcast=True)

    @gluon.jit
    def _tile_slots(table_row, stride_tm, block_size, g_len, tile, in_range, TILE: gl.constexpr,
                    layout: gl.constexpr):
        """Cache slots of the tile's positions, -1 past g_len or for a tile past the program's last."""
        pos = tile * TILE + gl.arange(0, TILE, layout=layout)
        live = (pos < g_len) & in_range
        block = gl.load(table_row + (pos // block_size) * stride_tm, mask=live, other=0)
        return gl.where(live, block.to(gl.int64) * block_size + pos % block_size, -1)

    @gluon.jit
    def _issue(keys_ptr, scale_ptr, stride_ks, slot, k_buf, s_buf, DIM: gl.constexpr, layout: gl.constexpr):
        """Start the copies of a tile's keys and scales; rows that are no key are zero-filled."""
        ok = slot >= 0
        safe = gl.where(ok, slot, 0)
        d = gl.arange(0, DIM, layout=gl.SliceLayout(0, layout))
        _async_load(k_buf, keys_ptr + safe[:, None] * stride_ks + d[None, :], mask=ok[:, None])
        _async_load(s_buf, scale_ptr + safe, mask=ok)

    @gluon.jit(do_not_specialize=["stride_tb", "tiles"])
    def _score_gluon_kernel(q_ptr, w_ptr, keys_ptr, scale_ptr, table_ptr, lens_ptr, out_ptr, m_ptr,
                            stride_qb, stride_qh, stride_qd, stride_wb, stride_wh,
                            stride_ks, stride_tb, stride_tm, stride_ob, stride_mb,
                            num_heads, width, block_size, w_scale, zero_ptr, zero_per_row, tiles,
                            DIM: gl.constexpr, TILE: gl.constexpr, NBUF: gl.constexpr, ZERO: gl.constexpr,
                            SKIP_DEAD: gl.constexpr, MAXIMA: gl.constexpr, num_warps: gl.constexpr,
                            PDL: gl.constexpr = 0):
        """Program (seq, p) scores tiles p, p + P, p + 2 P, ... (`tiles` of them, P programs a row),
        as kernels/index_score.py's _score_tile_kernel does, with its ZERO, SKIP_DEAD and MAXIMA."""
        if PDL >= 1:  # kernels/pdl.py
            gdc_wait()
        if PDL >= 2:
            gdc_launch_dependents()
        seq = gl.program_id(0)
        p = gl.program_id(1)
        programs = gl.num_programs(1)
        HEADS: gl.constexpr = 16

        # Copies: 16 bytes a thread along a key row. Products: scores [keys, heads] over the warps' rows.
        c_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (DIM // 16), DIM // 16], [num_warps, 1], [1, 0])
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, mma)
        slot_layout: gl.constexpr = gl.SliceLayout(1, c_layout)
        z_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

        if ZERO:  # the selection's workspace, a share of one row's worth each program
            share = gl.cdiv(zero_per_row, programs)
            first = p * share
            for i in range(0, share, 256):
                idx = first + i + gl.arange(0, 256, layout=z_layout)
                gl.store(zero_ptr + seq * zero_per_row + idx, gl.zeros([256], gl.int32, layout=z_layout),
                         mask=(idx < first + share) & (idx < zero_per_row))
        g_len = gl.load(lens_ptr + seq)
        if SKIP_DEAD:  # the one-launch select reads no score past g_len
            if p * TILE >= g_len:
                return
        table_row = table_ptr + seq * stride_tb
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
        k_smem = gl.allocate_shared_memory(keys_ptr.dtype.element_ty, [NBUF, TILE, DIM], flat)
        s_smem = gl.allocate_shared_memory(gl.float32, [NBUF, TILE],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        # Prologue: tiles 0 .. NBUF-2 in flight, tile NBUF-1's table entries in registers.
        for i in gl.static_range(NBUF - 1):
            slot = _tile_slots(table_row, stride_tm, block_size, g_len, p + i * programs, i < tiles, TILE,
                               slot_layout)
            _issue(keys_ptr, scale_ptr, stride_ks, slot, k_smem.index(i), s_smem.index(i), DIM, c_layout)
            cp.commit_group()
        nxt = _tile_slots(table_row, stride_tm, block_size, g_len, p + (NBUF - 1) * programs, NBUF - 1 < tiles,
                          TILE, slot_layout)

        # The query, scaled by a power of two into fp16 (E4M3 keys are exact there), and the head weights.
        q_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32 // HEADS, HEADS], [num_warps, 1], [1, 0])
        d = gl.arange(0, DIM, layout=gl.SliceLayout(1, q_layout))
        h = gl.arange(0, HEADS, layout=gl.SliceLayout(0, q_layout))
        qf = gl.load(q_ptr + seq * stride_qb + d[:, None] * stride_qd + h[None, :] * stride_qh,
                     mask=(h < num_heads)[None, :], other=0.0).to(gl.float32)
        q_exp = gl.maximum(gl.ceil(gl.log2(gl.max(gl.max(gl.abs(qf), axis=1), axis=0))) - 14.0, 0.0)
        q_op = gl.convert_layout((qf * gl.exp2(-q_exp)).to(gl.float16), b_layout)
        hw = gl.arange(0, HEADS, layout=gl.SliceLayout(0, mma))
        wt = gl.load(w_ptr + seq * stride_wb + hw * stride_wh, mask=hw < num_heads, other=0.0).to(gl.float32) * w_scale
        zero_acc = gl.zeros([TILE, HEADS], gl.float32, layout=mma)
        out_row = out_ptr + seq * stride_ob
        lane = gl.arange(0, TILE, layout=row_layout)
        best = gl.zeros([TILE], gl.uint32, layout=row_layout)

        for t in range(tiles):
            gl.thread_barrier()  # every warp is done with the buffer tile t - 1 was scored from
            # Tile t + NBUF - 1's copies go out (into the buffer tile t - 1 was scored from), and
            # the table entries of the tile after it are loaded, before tile t is scored.
            n = t + NBUF - 1
            _issue(keys_ptr, scale_ptr, stride_ks, nxt, k_smem.index(n % NBUF), s_smem.index(n % NBUF), DIM,
                   c_layout)
            cp.commit_group()
            nxt = _tile_slots(table_row, stride_tm, block_size, g_len, p + (n + 1) * programs, n + 1 < tiles,
                              TILE, slot_layout)
            cp.wait_group(NBUF - 1)  # tile t landed: this thread's copies, and after the barrier everyone's
            gl.thread_barrier()
            keys = k_smem.index(t % NBUF).load(a_layout).to(gl.float16)
            dots = mma_v2(keys, q_op, zero_acc) * gl.exp2(q_exp)
            score = gl.sum(gl.maximum(dots, 0.0) * wt[None, :], axis=1)
            score = score * s_smem.index(t % NBUF).load(row_layout)  # relu(q . (s k)) = s relu(q . k), s > 0
            pos = (p + t * programs) * TILE + lane
            score = gl.where(pos < g_len, score, float("-inf"))
            gl.store(out_row + pos, score, mask=pos < width)
            if MAXIMA:
                best = gl.maximum(best, _order_key(score))
        cp.wait_group(0)
        if MAXIMA:
            gl.store(m_ptr + seq * stride_mb + p * TILE + lane, _key_to_score(best))


def score_gluon(q, w, index_keys, key_scale, block_tables, g_lens, out, maxima, zero, skip_dead: bool,
                w_scale: float, block_size: int, programs: int, tile: int, num_warps: int, nbuf: int,
                pdl: dict | None = None) -> None:
    """Launch the Gluon scoring kernel over `programs` programs a row, each with `nbuf` buffers of
    `tile` keys (kernels/index_score.py _score_launch's arguments, already checked there)."""
    num_seqs, num_heads, head_dim = q.shape
    width = block_tables.shape[1] * block_size
    row_tiles = -(-width // tile)
    tiles = -(-row_tiles // programs)
    _score_gluon_kernel[(num_seqs, programs)](
        q, w, index_keys, key_scale, block_tables, g_lens, out, maxima if maxima is not None else out,
        q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
        index_keys.stride(0), block_tables.stride(0), block_tables.stride(1),
        out.stride(0), maxima.stride(0) if maxima is not None else 0,
        num_heads, width, block_size, float(w_scale), zero if zero is not None else g_lens,
        zero.numel() // num_seqs if zero is not None else 0, tiles,
        DIM=head_dim, TILE=tile, NBUF=nbuf, ZERO=zero is not None, SKIP_DEAD=skip_dead,
        MAXIMA=maxima is not None, num_warps=num_warps, **(pdl or {}))
