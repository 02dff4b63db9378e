"""The keys-as-rows MLA decode split kernel (wideep_kernels/mla_decode_rows.py) written in Gluon, Triton's
explicit-layout dialect, for Hopper: the same inputs, the same partial outputs, one more thing.

Why: in the Triton form the key tiles are gathered through an index (the resolved top-k slot),
and Triton's pipeliner then issues the next tile's copy *after* this tile's products and waits
for it at the top of the next iteration, so no load overlaps a product (a third stage would, but
three 64-key stages do not fit in shared memory). Here the loop is written out: the copies of
tile t+1 (cp.async, into the other of two buffers) are issued before tile t's products, and the
slots of tile t+2 are loaded while tile t computes, so the gather is in flight behind the MMAs.

Global keys are top-k slots, top-k positions (resolved here through the block table) or dense
rows; bf16/fp16 like the query, or FP8, which is dequantized into a bf16 tile in shared memory
before the products (Hopper MMAs take FP8 only K-major, and the second product reads the tile
transposed). Limits (the wrapper uses it only there, the Triton kernels elsewhere): Hopper MMAs,
at most 16 heads a program, rows aligned to 16 bytes.
"""
from __future__ import annotations

import functools

import torch

from wideep_kernels import _unusable
from wideep_kernels.fp8_kv import FP8_DTYPE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    # Triton 3.6 names the cp.async copy async_copy_global_to_shared, later releases async_load
    _async_load = getattr(cp, "async_load", None) or cp.async_copy_global_to_shared
    from wideep_kernels.pdl import gdc_launch_dependents, gdc_wait
except Exception:  # a Triton without Gluon, or without its Hopper ops
    gluon = None

BLOCK_N = 64  # keys a tile: the row block of both products (a Hopper MMA wants 64 rows)
# None: the launch configuration decides whether the Gluon split kernel runs; True / False force it
# where it applies (bench.forward --mla-gluon times the step both ways).
GLUON_OVERRIDE: bool | None = None


@functools.cache
def _has_wgmma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _rows_aligned(t: torch.Tensor) -> bool:
    """Every row of t (its last dimension) starts on 16 bytes: the Gluon kernel copies 16 at a time."""
    width = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % width == 0 for s in t.stride()[:-1])


def gluon_shapes_ok(q, kv, block_h: int, win_kv, *rows) -> bool:
    """The inputs the Gluon split kernel takes: a 16-bit query (its latent part `q`) and keys of its
    type or FP8, window rows of its type, one 16-head group, power-of-two latent (at least 64
    columns, the products' rows) and rope widths (the copies read whole widths, the rope at least
    16 bytes a row), and key rows (kv, window rows, fresh latents: `rows`) that start on 16 bytes."""
    same_type = kv.dtype in (q.dtype, FP8_DTYPE) and (win_kv is None or win_kv.dtype == q.dtype)
    kv_lora, rope = q.shape[-1], kv.shape[-1] - q.shape[-1]
    widths_ok = kv_lora >= 64 and 16 <= rope <= 256 and not (kv_lora & (kv_lora - 1)) and not (rope & (rope - 1))
    return (q.dtype in (torch.bfloat16, torch.float16) and same_type and block_h == 16 and widths_ok
            and all(_rows_aligned(t) for t in rows))


def gluon_applies(q, kv, config: dict | None, block_h: int, win_kv, *rows) -> bool:
    """Whether the Gluon split kernel runs: asked for by the launch configuration (or
    GLUON_OVERRIDE), on a Hopper GPU, for inputs it takes (gluon_shapes_ok)."""
    wanted = GLUON_OVERRIDE if GLUON_OVERRIDE is not None else bool((config or {}).get("gluon", False))
    if not wanted or gluon is None or not q.is_cuda or "mla_decode_gluon" in _unusable:
        return False
    return gluon_shapes_ok(q, kv, block_h, win_kv, *rows) and _has_wgmma(
        q.device.index if q.device.index is not None else torch.cuda.current_device())


if gluon is not None:

    @gluon.jit
    def _tile_start(t, tiles, BLOCK_N: gl.constexpr):
        """Range position of a split's t-th tile. A row's tiles are its live global ones, then its
        window ones, and split s of S takes every S-th: tiles s, s + S, ... tiles: (s, S, the row's
        live global tiles, the global span: where its window tiles start)."""
        first, stride, n_live, span = tiles
        i = first + t * stride
        past = (n_live <= i).to(gl.int32)  # (t may be a constant)
        return i * BLOCK_N + past * (span - n_live * BLOCK_N)

    @gluon.jit
    def _tile_entries(start, seq, BLOCK_N: gl.constexpr, HAS_TOPK: gl.constexpr, SLOTS: gl.constexpr,
                      HAS_WINDOW: gl.constexpr, layout: gl.constexpr, KEYS_ONLY: gl.constexpr = False):
        """The tile at range position `start`: its slots (global tiles; -1 = no key) and window flags.
        Loaded one tile ahead of their copies, so their latency hides behind a tile's products.
        seq: the sequence's (top-k row, block-table row, window-flag row, length, top-k count, window
        keys, global span, block size). The top-k row holds slots (SLOTS) or positions, resolved
        here through the block table; dense (no top-k): positions 0..length-1 through the table.
        KEYS_ONLY: only whether each entry is a key (slot 0 or -1), without the table read."""
        slots_row, table_row, flags_row, g_len, num_topk, num_win, span, block_size = seq
        idx = start + gl.arange(0, BLOCK_N, layout=layout)
        in_span = start < span
        if HAS_TOPK:
            pos = gl.load(slots_row + idx, mask=(idx < num_topk) & in_span, other=-1)
            if SLOTS:
                slot = pos
            else:
                ok = (pos >= 0) & (pos < g_len)
                if KEYS_ONLY:
                    slot = gl.where(ok, 0, -1)
                else:
                    block = gl.load(table_row + pos // block_size, mask=ok, other=0)
                    slot = gl.where(ok, block * block_size + pos % block_size, -1)
        else:
            ok = (idx < g_len) & in_span
            if KEYS_ONLY:
                slot = gl.where(ok, 0, -1)
            else:
                block = gl.load(table_row + idx // block_size, mask=ok, other=0)
                slot = gl.where(ok, block * block_size + idx % block_size, -1)
        if HAS_WINDOW:
            widx = idx - span
            flag = gl.load(flags_row + widx, mask=(widx >= 0) & (widx < num_win), other=0)
        else:
            flag = gl.zeros([BLOCK_N], gl.uint8, layout=layout)
        return slot, flag

    @gluon.jit
    def _tile_keys(start, span, slot, flag):
        """Which rows of the tile at `start` are keys, from its entries."""
        return gl.where(start < span, slot >= 0, flag != 0)

    @gluon.jit
    def _window_rows(start, span, ring, win_row0, stride_wi, fresh_row, BLOCK_N: gl.constexpr,
                     RING: gl.constexpr, layout: gl.constexpr):
        """Row pointers of the window keys at range positions start..start+BLOCK_N; ring = (ring_len,
        stride_fb)."""
        widx = start + gl.arange(0, BLOCK_N, layout=layout) - span
        if RING:  # ring rows, then the fresh latents fresh[b], fresh[b-1], ...
            ring_len, stride_fb = ring
            return gl.where(widx < ring_len, win_row0 + widx.to(gl.int64) * stride_wi,
                            fresh_row - (widx - ring_len).to(gl.int64) * stride_fb)
        return win_row0 + widx.to(gl.int64) * stride_wi

    @gluon.jit
    def _copy_rows(row, valid, safe_row, c_buf, r_buf, kv_lora, BLOCK_C: gl.constexpr, BLOCK_R: gl.constexpr,
                   layout: gl.constexpr):
        """Start the copies of a tile's rows into (c_buf, r_buf); rows that are no key are zero-filled
        (their probability is 0, and 0 x stale bits could be NaN)."""
        # every row starts 16-byte aligned (the wrapper checks), which the copies need: say so, as the
        # selects hide it from the compiler
        row = gl.multiple_of(gl.where(valid, row, safe_row), 16)
        cols = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, layout))
        _async_load(c_buf, row[:, None] + cols[None, :], mask=valid[:, None])
        rcols = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, layout))
        _async_load(r_buf, row[:, None] + kv_lora + rcols[None, :], mask=valid[:, None])

    @gluon.jit
    def _issue_tile(start, span, ring, slot, flag, kv_ptr, stride_kv, win_row0, stride_wi, fresh_row,
                    c_buf, r_buf, kv_lora,
                    BLOCK_N: gl.constexpr, BLOCK_C: gl.constexpr, BLOCK_R: gl.constexpr,
                    RING: gl.constexpr, c_layout: gl.constexpr):
        """The copies of one tile of the [global, window] range, keys in the query's type."""
        w_row = _window_rows(start, span, ring, win_row0, stride_wi, fresh_row, BLOCK_N, RING,
                             gl.SliceLayout(1, c_layout))
        row = gl.where(start < span, kv_ptr + slot.to(gl.int64) * stride_kv, w_row)
        _copy_rows(row, _tile_keys(start, span, slot, flag), kv_ptr, c_buf, r_buf, kv_lora, BLOCK_C, BLOCK_R,
                   c_layout)

    @gluon.jit
    def _dequantize(k8_c, k8_r, scale, kb_c, kb_r, BLOCK_C: gl.constexpr, CHUNK: gl.constexpr,
                    layout: gl.constexpr):
        """FP8 tile -> the query's type, each row times its scale, in shared memory (Hopper MMAs take
        FP8 only K-major, and the second product reads the tile transposed)."""
        dtype: gl.constexpr = kb_c.dtype
        for c in gl.static_range(0, BLOCK_C, CHUNK):
            x = k8_c.slice(c, CHUNK, dim=1).load(layout)
            kb_c.slice(c, CHUNK, dim=1).store((x.to(gl.float32) * scale[:, None]).to(dtype))
        x = k8_r.load(layout)
        kb_r.store((x.to(gl.float32) * scale[:, None]).to(dtype))

    @gluon.jit
    def _tile_update(k_c, k_r, qc_smem, qr_smem, p_smem, key_ok, m, l, acc, qk_scale, s_zero,
                     head_o: gl.constexpr):
        """Fold one tile of keys (in shared memory) into every head's running (max, sum, output^T)."""
        s = warpgroup_mma(k_c, qc_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(k_r, qr_smem.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where(key_ok[:, None], s * qk_scale, -1.0e30)
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        p = gl.where(key_ok[:, None], gl.exp2(s - m_new[None, :]), 0.0)
        l = l * alpha + gl.sum(p, axis=0)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        acc = acc * gl.convert_layout(alpha, head_o)[None, :]
        acc = warpgroup_mma(k_c.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return m_new, l, acc

    # The Triton split kernels' arguments, so that one launch site serves all three forms (PREC,
    # Q_RELOAD and UPCAST mean nothing here).
    @gluon.jit(do_not_specialize=["stride_tb", "table_keys", "num_topk", "num_win", "global_span"])
    def _gluon_split_kernel(
            q_ptr, stride_qb, stride_qh, qr_ptr, stride_rb, stride_rh,
            kv_ptr, stride_kv, scale_ptr,
            table_ptr, stride_tb, table_keys, glen_ptr,
            topk_ptr, stride_topk, num_topk,
            win_ptr, stride_wb, stride_wi, wvalid_ptr, stride_vb, num_win,
            ring_slot_ptr, fresh_ptr, stride_fb, ring_len, write_idx_ptr,
            part_acc_ptr, part_m_ptr, part_l_ptr,
            num_heads, kv_lora, rope, block_size, keys_per_split, global_span, qk_scale,
            BLOCK_H: gl.constexpr, BLOCK_C: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
            IS_FP8: gl.constexpr, HAS_TOPK: gl.constexpr, HAS_WINDOW: gl.constexpr, RING: gl.constexpr,
            PREC: gl.constexpr, SLOTS: gl.constexpr, Q_RELOAD: gl.constexpr, UPCAST: gl.constexpr,
            num_warps: gl.constexpr, RING_WRITE: gl.constexpr = 1, PDL: gl.constexpr = 0, DIRECT: gl.constexpr = 0):
        if PDL >= 1:  # wideep_kernels/pdl.py
            gdc_wait()
        if PDL >= 2:
            gdc_launch_dependents()
        split = gl.program_id(0)
        head_group = gl.program_id(1)
        b = gl.program_id(2)
        num_splits = gl.num_programs(0)
        dtype: gl.constexpr = q_ptr.dtype.element_ty

        # Layouts. Copies: 16 bytes a thread; the latent and rope parts of a row share one layout (their
        # row pointers then need no conversion), a warp's threads spanning the rope width. Products:
        # scores^T [keys, heads] on one warpgroup's rows, out^T [latent, heads] with the latent split
        # over the warps.
        c_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_R // 8), BLOCK_R // 8], [num_warps, 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, BLOCK_H // (num_warps // 4), 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_H, 16])
        head_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        head_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        key_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        slot_layout: gl.constexpr = gl.SliceLayout(1, c_layout)

        # The query, stored once as [heads, columns]; its transposed view is each product's B operand.
        heads_c = head_group * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, c_layout))
        cols_c = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, c_layout))
        qc = gl.load(q_ptr + b * stride_qb + heads_c[:, None] * stride_qh + cols_c[None, :],
                     mask=(heads_c < num_heads)[:, None] & (cols_c < kv_lora)[None, :], other=0.0)
        heads_r = head_group * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, c_layout))
        cols_r = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, c_layout))
        qr = gl.load(qr_ptr + b * stride_rb + heads_r[:, None] * stride_rh + cols_r[None, :],
                     mask=(heads_r < num_heads)[:, None] & (cols_r < rope)[None, :], other=0.0)
        qc_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_C],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_C], dtype), qc)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_R],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_R], dtype), qr)
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_H],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], dtype))

        m = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=head_s)
        l = gl.zeros([BLOCK_H], gl.float32, layout=head_s)
        acc = gl.zeros([BLOCK_C, BLOCK_H], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=s_layout)

        # This split's tiles of the row: of its live global tiles (those past a dense row's length
        # hold no key: a graph's block table may be far wider than the context), then its window
        # tiles, every num_splits-th. Taking them in turn rather than as one contiguous run keeps
        # the splits even whatever the row's length against the table's width (keys_per_split,
        # which the host sizes the splits by, is not used here).
        slots_row = topk_ptr + b * stride_topk
        table_row = table_ptr + b * stride_tb
        g_len = gl.minimum(gl.load(glen_ptr + b), table_keys)
        if HAS_TOPK:
            n_live = global_span // BLOCK_N
        else:
            n_live = gl.cdiv(gl.minimum(g_len, global_span), BLOCK_N)
        n_row = n_live + gl.cdiv(num_win, BLOCK_N)
        n_tiles = gl.cdiv(gl.maximum(n_row - split, 0), num_splits)
        n_global_tiles = gl.cdiv(gl.maximum(n_live - split, 0), num_splits)
        tiles = (split, num_splits, n_live, global_span)
        flags_row = wvalid_ptr + b * stride_vb
        seq = (slots_row, table_row, flags_row, g_len, num_topk, num_win, global_span, block_size)
        ring = (ring_len, stride_fb)
        if RING:
            win_row0 = win_ptr + gl.load(ring_slot_ptr + b).to(gl.int64) * stride_wb
            fresh_row = fresh_ptr + b * stride_fb
        else:
            win_row0 = win_ptr + b * stride_wb
            fresh_row = win_row0

        if IS_FP8:
            # FP8 global tiles: copied (double-buffered, as below) as bytes, then dequantized into one
            # tile of the query's type that both products read. The window's rows are bf16 already:
            # copied straight into that tile, one at a time (a split holds at most a few of them).
            k8_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BLOCK_R // 16), BLOCK_R // 16],
                                                       [num_warps, 1], [1, 0])
            row8: gl.constexpr = gl.SliceLayout(1, k8_layout)
            flat: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
            k8_c = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [2, BLOCK_N, BLOCK_C], flat)
            k8_r = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [2, BLOCK_N, BLOCK_R], flat)
            kb_c = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_C],
                                             gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_C], dtype))
            kb_r = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_R],
                                             gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], dtype))
            step = num_splits * BLOCK_N
            slot, flag = _tile_entries(split * BLOCK_N, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, row8)
            slot = gl.where(n_global_tiles > 0, slot, -1)
            scale = gl.load(scale_ptr + slot, mask=slot >= 0, other=0.0)
            _copy_rows(kv_ptr + slot.to(gl.int64) * stride_kv, slot >= 0, kv_ptr, k8_c.index(0), k8_r.index(0),
                       kv_lora, BLOCK_C, BLOCK_R, k8_layout)
            cp.commit_group()
            slot, flag = _tile_entries(split * BLOCK_N + step, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, row8)
            for t in range(n_global_tiles):
                start = split * BLOCK_N + t * step
                nxt = gl.where(t + 1 < n_global_tiles, slot, -1)
                _copy_rows(kv_ptr + nxt.to(gl.int64) * stride_kv, nxt >= 0, kv_ptr, k8_c.index((t + 1) % 2),
                           k8_r.index((t + 1) % 2), kv_lora, BLOCK_C, BLOCK_R, k8_layout)
                cp.commit_group()
                next_scale = gl.load(scale_ptr + nxt, mask=nxt >= 0, other=0.0)
                key_slot, key_flag = _tile_entries(start, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, key_s, True)
                slot, flag = _tile_entries(start + 2 * step, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, row8)
                cp.wait_group(1)
                _dequantize(k8_c.index(t % 2), k8_r.index(t % 2), scale, kb_c, kb_r, BLOCK_C, 128, k8_layout)
                fence_async_shared()
                m, l, acc = _tile_update(kb_c, kb_r, qc_smem, qr_smem, p_smem, key_slot >= 0, m, l, acc, qk_scale,
                                         s_zero, head_o)
                scale = next_scale
            cp.wait_group(0)
            if HAS_WINDOW:
                for t in range(n_global_tiles, n_tiles):
                    start = _tile_start(t, tiles, BLOCK_N)
                    w_slot, w_flag = _tile_entries(start, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, slot_layout)
                    w_row = _window_rows(start, global_span, ring, win_row0, stride_wi, fresh_row, BLOCK_N, RING,
                                         slot_layout)
                    _copy_rows(w_row, w_flag != 0, win_row0, kb_c, kb_r, kv_lora, BLOCK_C, BLOCK_R, c_layout)
                    cp.commit_group()
                    key_slot, key_flag = _tile_entries(start, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, key_s, True)
                    cp.wait_group(0)
                    fence_async_shared()
                    m, l, acc = _tile_update(kb_c, kb_r, qc_smem, qr_smem, p_smem, key_flag != 0, m, l, acc,
                                             qk_scale, s_zero, head_o)
        else:
            c_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_C],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_C], dtype))
            r_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_R],
                                               gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], dtype))
            # Prologue: tile 0's copies in flight, tile 1's slots in registers.
            first = _tile_start(0, tiles, BLOCK_N)
            slot, flag = _tile_entries(first, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, slot_layout)
            _issue_tile(first, global_span, ring, slot, flag, kv_ptr, stride_kv, win_row0, stride_wi,
                        fresh_row, c_smem.index(0), r_smem.index(0), kv_lora, BLOCK_N, BLOCK_C, BLOCK_R, RING,
                        c_layout)
            cp.commit_group()
            slot, flag = _tile_entries(_tile_start(1, tiles, BLOCK_N), seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW,
                                       slot_layout)
            for t in range(n_tiles):
                start = _tile_start(t, tiles, BLOCK_N)
                # Tile t+1's copies go out before tile t's products (past the end: every row masked off).
                nxt = _tile_start(t + 1, tiles, BLOCK_N)
                live = t + 1 < n_tiles
                _issue_tile(nxt, global_span, ring, gl.where(live, slot, -1), gl.where(live, flag, 0),
                            kv_ptr, stride_kv, win_row0, stride_wi, fresh_row, c_smem.index((t + 1) % 2),
                            r_smem.index((t + 1) % 2), kv_lora, BLOCK_N, BLOCK_C, BLOCK_R, RING, c_layout)
                cp.commit_group()
                # tile t's keys, read again in the scores' layout (cached: cheaper than a layout
                # conversion, which is a shared-memory round trip and a barrier)
                key_slot, key_flag = _tile_entries(start, seq, BLOCK_N, HAS_TOPK, SLOTS, HAS_WINDOW, key_s, True)
                key_ok = _tile_keys(start, global_span, key_slot, key_flag)
                slot, flag = _tile_entries(_tile_start(t + 2, tiles, BLOCK_N), seq, BLOCK_N, HAS_TOPK, SLOTS,
                                           HAS_WINDOW, slot_layout)
                cp.wait_group(1)  # tile t landed (this thread's copies; the barrier before the MMA: the rest)
                fence_async_shared()
                m, l, acc = _tile_update(c_smem.index(t % 2), r_smem.index(t % 2), qc_smem, qr_smem, p_smem,
                                         key_ok, m, l, acc, qk_scale, s_zero, head_o)
            cp.wait_group(0)

        if RING_WRITE:
            if (split == num_splits - 1) & (head_group == 0):
                # the step's ring update (see mla_decode_rows; other splits read the entry masked)
                w_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
                wc = gl.arange(0, BLOCK_C, layout=w_layout)
                wr = gl.arange(0, BLOCK_R, layout=w_layout)
                dst = win_row0 + gl.load(write_idx_ptr + b).to(gl.int64) * stride_wi
                gl.store(dst + wc, gl.load(fresh_row + wc, mask=wc < kv_lora), mask=wc < kv_lora)
                gl.store(dst + kv_lora + wr, gl.load(fresh_row + kv_lora + wr, mask=wr < rope), mask=wr < rope)

        heads_o = head_group * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_o)
        part_o = (b * num_splits + split) * num_heads + heads_o
        cols_o = gl.arange(0, BLOCK_C, layout=gl.SliceLayout(1, o_layout))
        o_mask = (heads_o < num_heads)[None, :] & (cols_o < kv_lora)[:, None]
        if DIRECT:
            # The row's only split: its sums are the row's, so it writes the output [B, H, kv_lora]
            # (part_acc_ptr, the same offsets at one split) and no merge runs; no key -> zeros.
            l_o = gl.convert_layout(l, head_o)
            o = gl.where(l_o[None, :] > 0, acc / gl.where(l_o > 0, l_o, 1.0)[None, :], 0.0)
            gl.store(part_acc_ptr + part_o[None, :].to(gl.int64) * kv_lora + cols_o[:, None],
                     o.to(part_acc_ptr.dtype.element_ty), mask=o_mask)
        else:
            heads = head_group * BLOCK_H + gl.arange(0, BLOCK_H, layout=head_s)
            part = (b * num_splits + split) * num_heads + heads
            gl.store(part_m_ptr + part, m, mask=heads < num_heads)
            gl.store(part_l_ptr + part, l, mask=heads < num_heads)
            gl.store(part_acc_ptr + part_o[None, :].to(gl.int64) * kv_lora + cols_o[:, None], acc, mask=o_mask)
else:
    _gluon_split_kernel = None
