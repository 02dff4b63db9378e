"""The MLA decode split kernel with keys as rows: the inputs and partial outputs of
wideep_kernels/mla_decode.py's `_split_kernel`, computed as scores^T = keys x q^T and out^T = keys^T x p^T.

Why a second form: with 16 heads the query is a single 16-row block, so in the heads-as-rows
form every warp keeps the whole [16, 512] query operand in registers (128 a thread) beside the
fp32 accumulator, and the kernel runs at 255 registers with spills. With keys as rows, a 64-key
tile is the row block of both products, which on Hopper are warpgroup MMAs reading the key
tile, the transposed query and the probabilities from shared memory (ptxas for sm_90: 8 warps,
36 bytes of spills against the other form's 428 at 4 warps).

Two 64-key stages of 576-wide bf16 rows take 165 KB of shared memory: one program an SM. So the
splits differ: global keys (padded to whole tiles) and then the window keys form one range, cut
into at most `waves` programs an SM, and a split may hold both kinds of tile. The window keys
(ring rows, then the fresh latents) are read through one select of row pointers, so every tile
is a single gather that is staged in shared memory.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter
except Exception:
    triton = None


if triton is not None:

    @triton.jit
    def _rows_tile_update(qt_c, qt_r, k_c, k_r, valid, k_scale, m, l, acc, qk_scale,
                          HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        """Fold one tile of keys ([BLOCK_N, D] rows) into every head's running (max, sum, output^T)."""
        k_c = k_c.to(qt_c.dtype)
        k_r = k_r.to(qt_c.dtype)
        s = tl.dot(k_c, qt_c, input_precision=PREC)
        s += tl.dot(k_r, qt_r, input_precision=PREC)
        if HAS_SCALE:
            s = s * k_scale[:, None]
        s = tl.where(valid[:, None], s * qk_scale, -1.0e30)
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp2(m - m_new)
        p = tl.where(valid[:, None], tl.exp2(s - m_new[None, :]), 0.0)
        l = l * alpha + tl.sum(p, 0)
        if HAS_SCALE:
            k_max = tl.max(tl.where(valid, k_scale, 0.0), 0)
            k_max = tl.where(k_max > 0, k_max, 1.0)
            pv = (p * (k_scale / k_max)[:, None]).to(k_c.dtype)
            acc = acc * alpha[None, :] + tl.dot(tl.trans(k_c), pv, input_precision=PREC) * k_max
        else:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(k_c), p.to(k_c.dtype), input_precision=PREC)
        return m_new, l, acc

    @triton.jit
    def _global_tile(start, g_end, b, g_len, topk_ptr, stride_topk, table_ptr, stride_tb, kv_ptr, stride_kv,
                     scale_ptr, kv_lora, block_size, cols, c_ok, rcols, r_ok,
                     BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr, HAS_TOPK: tl.constexpr, SLOTS: tl.constexpr):
        """The global keys start..start+BLOCK_N (none at or past g_end): latent part, rope part,
        per-key scale (FP8) and which are keys."""
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < g_end
        if SLOTS:  # top-k entries already resolved to slots (-1 = none)
            slot = tl.load(topk_ptr + b * stride_topk + idx, mask=valid, other=-1)
            valid = valid & (slot >= 0)
            slot = tl.where(valid, slot, 0).to(tl.int64)
        else:
            if HAS_TOPK:
                pos = tl.load(topk_ptr + b * stride_topk + idx, mask=valid, other=-1)
                valid = valid & (pos >= 0) & (pos < g_len)
                pos = tl.where(valid, pos, 0)
            else:
                pos = idx
            block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=valid, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
        row = kv_ptr + slot[:, None] * stride_kv
        k_c = tl.load(row + cols[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
        k_r = tl.load(row + kv_lora + rcols[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        if IS_FP8:
            k_scale = tl.load(scale_ptr + slot, mask=valid, other=0.0)
        else:
            k_scale = tl.zeros([BLOCK_N], dtype=tl.float32)
        return k_c, k_r, k_scale, valid

    @triton.jit(do_not_specialize=["stride_tb", "table_keys", "num_topk", "num_win", "global_span"])
    def _rows_split_kernel(
            q_ptr, stride_qb, stride_qh, qr_ptr, stride_rb, stride_rh,
            kv_ptr, stride_kv, scale_ptr,
            table_ptr, stride_tb, table_keys, glen_ptr,
            topk_ptr, stride_topk, num_topk,
            win_ptr, stride_wb, stride_wi, wvalid_ptr, stride_vb, num_win,
            ring_slot_ptr, fresh_ptr, stride_fb, ring_len, write_idx_ptr,
            part_acc_ptr, part_m_ptr, part_l_ptr,
            num_heads, kv_lora, rope, block_size, keys_per_split, global_span, qk_scale,
            BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
            IS_FP8: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_WINDOW: tl.constexpr, RING: tl.constexpr,
            PREC: tl.constexpr, SLOTS: tl.constexpr, Q_RELOAD: tl.constexpr,
            UPCAST: tl.constexpr, RING_WRITE: tl.constexpr = 1, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        split = tl.program_id(0)
        head_group = tl.program_id(1)
        b = tl.program_id(2)
        num_splits = tl.num_programs(0)

        heads = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < num_heads
        cols = tl.arange(0, BLOCK_C)
        c_ok = cols < kv_lora
        rcols = tl.arange(0, BLOCK_R)
        r_ok = rcols < rope
        # the query transposed: [columns, heads]
        qt_c = tl.load(q_ptr + b * stride_qb + heads[None, :] * stride_qh + cols[:, None],
                       mask=h_ok[None, :] & c_ok[:, None], other=0.0)
        qt_r = tl.load(qr_ptr + b * stride_rb + heads[None, :] * stride_rh + rcols[:, None],
                       mask=h_ok[None, :] & r_ok[:, None], other=0.0)
        if UPCAST:
            qt_c = qt_c.to(tl.float32)
            qt_r = qt_r.to(tl.float32)

        m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_C, BLOCK_H], dtype=tl.float32)

        g_len = tl.minimum(tl.load(glen_ptr + b), table_keys)
        if HAS_TOPK:
            n_global = num_topk
        else:
            n_global = g_len
        # This split's tiles of the row: its global tiles (up to the row's length: a graph's table
        # may be far wider), then its window tiles, every num_splits-th, as the Gluon kernel takes
        # them (mla_decode_gluon.py): the splits stay even whatever the table's width
        # (keys_per_split, which the host sizes the splits by, is not used here).
        n_gt = tl.cdiv(n_global, BLOCK_N)
        for t in range(split, n_gt, num_splits):
            k_c, k_r, k_scale, valid = _global_tile(
                t * BLOCK_N, n_global, b, g_len, topk_ptr, stride_topk, table_ptr, stride_tb, kv_ptr, stride_kv,
                scale_ptr, kv_lora, block_size, cols, c_ok, rcols, r_ok, BLOCK_N, IS_FP8, HAS_TOPK, SLOTS)
            m, l, acc = _rows_tile_update(qt_c, qt_r, k_c, k_r, valid, k_scale, m, l, acc, qk_scale, IS_FP8, PREC)

        if HAS_WINDOW:
            if RING:
                ring_row0 = win_ptr + tl.load(ring_slot_ptr + b).to(tl.int64) * stride_wb
                fresh_row = fresh_ptr + b * stride_fb
            # window tile j is the row's tile n_gt + j
            for j in range((split + num_splits - n_gt % num_splits) % num_splits, tl.cdiv(num_win, BLOCK_N),
                           num_splits):
                start = j * BLOCK_N
                idx = start + tl.arange(0, BLOCK_N)
                valid = idx < num_win
                flag = tl.load(wvalid_ptr + b * stride_vb + idx, mask=valid, other=0)
                valid = valid & (flag != 0)
                if RING:
                    # ring rows, then the fresh latents fresh[b], fresh[b-1], ...: one gather of row
                    # pointers
                    in_ring = idx < ring_len
                    row = tl.where(in_ring[:, None], ring_row0 + idx[:, None].to(tl.int64) * stride_wi,
                                   fresh_row - (idx[:, None] - ring_len).to(tl.int64) * stride_fb)
                else:
                    row = win_ptr + b * stride_wb + idx[:, None].to(tl.int64) * stride_wi
                k_c = tl.load(row + cols[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
                k_r = tl.load(row + kv_lora + rcols[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
                no_scale = tl.zeros([BLOCK_N], dtype=tl.float32)
                m, l, acc = _rows_tile_update(qt_c, qt_r, k_c, k_r, valid, no_scale, m, l, acc, qk_scale, False,
                                              PREC)
            if RING_WRITE:
                if (split == num_splits - 1) & (head_group == 0):
                    # the step's ring update (see `_split_kernel`; other splits may read the
                    # overwritten entry before or after, it is masked either way)
                    dst = ring_row0 + tl.load(write_idx_ptr + b).to(tl.int64) * stride_wi
                    tl.store(dst + cols, tl.load(fresh_row + cols, mask=c_ok), mask=c_ok)
                    tl.store(dst + kv_lora + rcols, tl.load(fresh_row + kv_lora + rcols, mask=r_ok), mask=r_ok)

        part = (b * num_splits + split) * num_heads + heads
        tl.store(part_m_ptr + part, m, mask=h_ok)
        tl.store(part_l_ptr + part, l, mask=h_ok)
        tl.store(part_acc_ptr + part[None, :].to(tl.int64) * kv_lora + cols[:, None], acc,
                 mask=h_ok[None, :] & c_ok[:, None])
else:
    _global_tile = _rows_split_kernel = None
