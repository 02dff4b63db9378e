"""Paged MLA decode attention in the absorbed form, with an optional FP8 latent KV.

One decode query per sequence, H heads, all heads scoring the same keys: the latents of
width D = kv_lora + rope. Values are the first kv_lora columns of those latents.

Keys of sequence b are the union of
- global keys: positions 0..g_lens[b]-1 of the paged latent slab (slot = table[b, j // bs] * bs
  + j % bs), or, when topk_pos is given, only the positions it lists (-1 = no entry);
- window keys: win_kv[b, i] where win_valid[b, i]; or, given `ring`, the sequence's window ring
  rows ring_kv[ring_slots[b], i] (i < W) followed by its fresh latent fresh[b], which the kernel
  then writes into ring_kv[ring_slots[b], write_idx[b]] (the decode step's ring update, so the
  gather, concatenation and write around the kernel are not separate launches). Rows of a prompt
  chunk (write_idx None) read F fresh latents, fresh[b], fresh[b-1], ..., fresh[b-F+1] (the
  chunk's rows before it, win_valid [B, W+F] saying which are in its window), and write nothing:
  so a chunk step reads each sequence's ring and latents in place instead of gathering a
  [rows, W+F, D] copy of them, 0.6 GB a layer at 2048 rows of a 128-entry window.

The Triton path is flash-decoding: the keys of a sequence are cut into splits, each program
loads a KV tile once for all heads (tl.dot of [H, D] x [D, BLOCK_N]) and keeps an online
softmax; a second small kernel merges the per-split (max, sum, partial output). The launch
configuration (wideep_kernels/tuning.py) may pick wideep_kernels/mla_decode_rows.py's split kernel instead,
which computes the same with keys as the rows of its products.
"""
from __future__ import annotations

import torch

from wideep_kernels import _unusable, log, triton_ok
from wideep_kernels.fp8_kv import FP8_DTYPE
from wideep_kernels.mla_decode_gluon import BLOCK_N as GLUON_BLOCK_N, _gluon_split_kernel, gluon_applies
from wideep_kernels.mla_decode_rows import _global_tile, _rows_split_kernel
from wideep_kernels.mla_reference import mla_decode_reference
from wideep_kernels.tuning import BATCH_BUCKETS, batch_bucket, tuned_config

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # the reference path needs no Triton
    triton = None

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _tile_update(q_c, q_r, k_c, k_r, valid, k_scale, m, l, acc, qk_scale,
                     HAS_SCALE: tl.constexpr, PREC: tl.constexpr):
        """Fold one tile of keys into the running (max, sum, output) of every head."""
        k_c = k_c.to(q_c.dtype)
        k_r = k_r.to(q_c.dtype)
        s = tl.dot(q_c, tl.trans(k_c), input_precision=PREC)
        s += tl.dot(q_r, tl.trans(k_r), input_precision=PREC)
        if HAS_SCALE:
            # Per-key scales commute with the dot: apply them to scores, not to the whole tile.
            s = s * k_scale[None, :]
        # Finite floor instead of -inf so that a tile with no valid key gives no NaN.
        s = tl.where(valid[None, :], s * qk_scale, -1.0e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.where(valid[None, :], tl.exp2(s - m_new[:, None]), 0.0)
        l = l * alpha + tl.sum(p, 1)
        if HAS_SCALE:
            # Scaled relative to the tile's largest scale so that p stays in range when cast
            # to 16 bits; the largest scale is multiplied back on the [H, C] product.
            k_max = tl.max(tl.where(valid, k_scale, 0.0), 0)
            k_max = tl.where(k_max > 0, k_max, 1.0)
            pv = (p * (k_scale / k_max)[None, :]).to(k_c.dtype)
            acc = acc * alpha[:, None] + tl.dot(pv, k_c, input_precision=PREC) * k_max
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision=PREC)
        return m_new, l, acc

    @triton.jit
    def _load_q(q_ptr, qr_ptr, b, stride_qb, stride_qh, stride_rb, stride_rh, heads, h_ok, cols, c_ok, rcols, r_ok,
                UPCAST: tl.constexpr):
        q_c = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                      mask=h_ok[:, None] & c_ok[None, :], other=0.0)
        q_r = tl.load(qr_ptr + b * stride_rb + heads[:, None] * stride_rh + rcols[None, :],
                      mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        if UPCAST:  # every dot operand follows q's type
            q_c = q_c.to(tl.float32)
            q_r = q_r.to(tl.float32)
        return q_c, q_r

    # Block-table widths and split counts change with context and batch; as plain (unspecialised)
    # integers they do not each get a build of their own (see wideep_kernels/indexer.py).
    @triton.jit(do_not_specialize=["stride_tb", "table_keys", "num_topk", "num_win", "num_global_splits"])
    def _split_kernel(
            q_ptr, stride_qb, stride_qh, qr_ptr, stride_rb, stride_rh,
            kv_ptr, stride_kv, scale_ptr,
            table_ptr, stride_tb, table_keys, glen_ptr,
            topk_ptr, stride_topk, num_topk,
            win_ptr, stride_wb, stride_wi, wvalid_ptr, stride_vb, num_win,
            ring_slot_ptr, fresh_ptr, stride_fb, ring_len, write_idx_ptr,
            part_acc_ptr, part_m_ptr, part_l_ptr,
            num_heads, kv_lora, rope, block_size, keys_per_split, num_global_splits, qk_scale,
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
        q_c, q_r = _load_q(q_ptr, qr_ptr, b, stride_qb, stride_qh, stride_rb, stride_rh, heads, h_ok, cols, c_ok,
                           rcols, r_ok, UPCAST)

        m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)

        # Never read past the block table, whatever g_lens says.
        g_len = tl.minimum(tl.load(glen_ptr + b), table_keys)
        if HAS_TOPK:
            n_global = num_topk
        else:
            n_global = g_len
        # The global splits take every num_global_splits-th tile of the row's keys, so they stay
        # even however much wider than the row the block table is (a CUDA graph's shared width);
        # keys_per_split, their contiguous share, is only what the host sized them by. The window
        # split's global loop is empty.
        n_gt = tl.cdiv(n_global, BLOCK_N)
        for t in range(tl.where(split < num_global_splits, split, n_gt), n_gt, num_global_splits):
            start = t * BLOCK_N
            k_c, k_r, k_scale, valid = _global_tile(
                start, n_global, b, g_len, topk_ptr, stride_topk, table_ptr, stride_tb, kv_ptr, stride_kv,
                scale_ptr, kv_lora, block_size, cols, c_ok, rcols, r_ok, BLOCK_N, IS_FP8, HAS_TOPK, SLOTS)
            if Q_RELOAD:
                # The query, kept live across the loop, is a whole dot operand in every warp (at 16
                # heads x 512, 128 registers a thread); re-read from L1 each tile instead. Within
                # 1-4% on the H200 (bench.probe_mla), so only on request.
                q_c, q_r = _load_q(q_ptr, qr_ptr, b, stride_qb, stride_qh, stride_rb, stride_rh, heads, h_ok, cols,
                                   c_ok, rcols, r_ok, UPCAST)
            m, l, acc = _tile_update(q_c, q_r, k_c, k_r, valid, k_scale, m, l, acc, qk_scale, IS_FP8, PREC)

        if HAS_WINDOW:
            w_end = tl.where(split == num_global_splits, num_win, 0)
            if RING:
                ring_row0 = win_ptr + tl.load(ring_slot_ptr + b).to(tl.int64) * stride_wb
            for start in range(0, w_end, BLOCK_N):
                idx = start + tl.arange(0, BLOCK_N)
                valid = idx < num_win
                flag = tl.load(wvalid_ptr + b * stride_vb + idx, mask=valid, other=0)
                valid = valid & (flag != 0)
                if RING:
                    # ring rows, then the fresh latents fresh[b], fresh[b-1], ...: two masked loads
                    in_ring = valid & (idx < ring_len)
                    fresh = valid & (idx >= ring_len)
                    row = ring_row0 + idx[:, None].to(tl.int64) * stride_wi
                    frow = fresh_ptr + (b - (idx[:, None] - ring_len)).to(tl.int64) * stride_fb
                    k_c = tl.load(row + cols[None, :], mask=in_ring[:, None] & c_ok[None, :], other=0.0) + \
                        tl.load(frow + cols[None, :], mask=fresh[:, None] & c_ok[None, :], other=0.0)
                    k_r = tl.load(row + kv_lora + rcols[None, :], mask=in_ring[:, None] & r_ok[None, :], other=0.0) + \
                        tl.load(frow + kv_lora + rcols[None, :], mask=fresh[:, None] & r_ok[None, :], other=0.0)
                else:
                    row = win_ptr + b * stride_wb + idx[:, None].to(tl.int64) * stride_wi
                    k_c = tl.load(row + cols[None, :], mask=valid[:, None] & c_ok[None, :], other=0.0)
                    k_r = tl.load(row + kv_lora + rcols[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
                no_scale = tl.zeros([BLOCK_N], dtype=tl.float32)
                if Q_RELOAD:
                    q_c, q_r = _load_q(q_ptr, qr_ptr, b, stride_qb, stride_qh, stride_rb, stride_rh, heads, h_ok, cols,
                                       c_ok, rcols, r_ok, UPCAST)
                m, l, acc = _tile_update(q_c, q_r, k_c, k_r, valid, no_scale, m, l, acc, qk_scale, False, PREC)
            if RING_WRITE:
                if (split == num_global_splits) & (head_group == 0):
                    # The step's ring update. It overwrites the entry of position p - W, which no
                    # query of this step reads (outside every window), so the programs of other
                    # head groups may read that entry before or after: either way it is masked.
                    dst = ring_row0 + tl.load(write_idx_ptr + b).to(tl.int64) * stride_wi
                    src = fresh_ptr + b * stride_fb
                    tl.store(dst + cols, tl.load(src + cols, mask=c_ok), mask=c_ok)
                    tl.store(dst + kv_lora + rcols, tl.load(src + kv_lora + rcols, mask=r_ok), mask=r_ok)

        part = (b * num_splits + split) * num_heads + heads
        tl.store(part_m_ptr + part, m, mask=h_ok)
        tl.store(part_l_ptr + part, l, mask=h_ok)
        tl.store(part_acc_ptr + part[:, None].to(tl.int64) * kv_lora + cols[None, :], acc,
                 mask=h_ok[:, None] & c_ok[None, :])

    @triton.jit(do_not_specialize=["stride_topk", "stride_tb", "table_keys", "num_topk"])
    def _resolve_slots_kernel(topk_ptr, stride_topk, table_ptr, stride_tb, table_keys, glen_ptr, out_ptr,
                              num_topk, block_size, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        """Top-k positions to KV slots (-1 where none or past the sequence), once per layer: the
        attention programs then load a slot and its row, two dependent reads instead of three."""
        pdl_enter(PDL)
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        b = tl.program_id(1)
        ok = idx < num_topk
        g_len = tl.minimum(tl.load(glen_ptr + b), table_keys)
        pos = tl.load(topk_ptr + b * stride_topk + idx, mask=ok, other=-1)
        valid = ok & (pos >= 0) & (pos < g_len)
        pos = tl.where(valid, pos, 0)
        block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=valid, other=0)
        tl.store(out_ptr + b * num_topk + idx, tl.where(valid, block * block_size + pos % block_size, -1), mask=ok)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_kernel(part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_ob, stride_oh,
                      num_splits, num_heads, kv_lora,
                      BLOCK_SC: tl.constexpr, BLOCK_CC: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_enter(PDL)
        col_block = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        base = b * num_splits * num_heads + h
        # One pass over the splits, BLOCK_SC at a time, rescaling what is summed so far whenever a
        # larger maximum comes (no block size follows the number of splits, so one build serves
        # every batch and context): a first pass for the maxima alone doubled the serial loop,
        # which is this kernel's time where its programs are few (batch 1, a wide graph table).
        m_run = tl.full([], -1.0e30, dtype=tl.float32)
        denom = tl.zeros([], dtype=tl.float32)
        cols = col_block * BLOCK_CC + tl.arange(0, BLOCK_CC)
        c_ok = cols < kv_lora
        total = tl.zeros([BLOCK_CC], dtype=tl.float32)
        for s0 in range(0, num_splits, BLOCK_SC):
            sc = s0 + tl.arange(0, BLOCK_SC)
            sc_ok = sc < num_splits
            ms = tl.load(part_m_ptr + base + sc * num_heads, mask=sc_ok, other=-1.0e30)
            m_new = tl.maximum(m_run, tl.max(ms, 0))
            alpha = tl.exp2(m_run - m_new)
            w = tl.where(sc_ok, tl.exp2(ms - m_new), 0.0)
            denom = denom * alpha + tl.sum(w * tl.load(part_l_ptr + base + sc * num_heads, mask=sc_ok, other=0.0), 0)
            # A split that saw no key (its maximum still the initial one) adds nothing: its partial
            # sum is not read. A graph's table may be far wider than the context, and at batch 1
            # most of its splits are past the keys.
            live = sc_ok & (ms > -1.0e30)
            rows = (base + sc * num_heads).to(tl.int64) * kv_lora
            part = tl.load(part_acc_ptr + rows[:, None] + cols[None, :], mask=live[:, None] & c_ok[None, :],
                           other=0.0)
            total = total * alpha + tl.sum(part * w[:, None], 0)
            m_run = m_new
        out = tl.where(denom > 0, total / tl.where(denom > 0, denom, 1.0), 0.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + cols, out.to(out_ptr.dtype.element_ty), mask=c_ok)


def _flags(valid: torch.Tensor) -> torch.Tensor:
    """uint8 flags the kernel reads; a contiguous bool tensor is read in place (a cast would be
    a launch per layer)."""
    if valid.dtype == torch.bool and valid.is_contiguous():
        return valid.view(torch.uint8)
    return valid.to(torch.uint8).contiguous()


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def _tile_config(block_c: int, block_h: int, kv_bytes: int, q_dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Chosen from sm_90 builds (ptxas register and shared
    memory counts, cp.async pipelining of the key tiles), not from timings: at D = 576,
    16 heads, a 64-key bf16 tile needs 139 registers and no spill; FP8 tiles are converted
    through registers, so they stay at 32 keys."""
    if block_c < 256:  # small test shapes
        return 16, 4, 2
    if q_dtype == torch.float32 or kv_bytes == 4 or block_h > 16:
        return 32, 8, 2
    if kv_bytes == 1:
        return 32, 8, 3
    return 64, 8, 3


def _target_programs(device: torch.device, waves: int = 2) -> int:
    if device.type == "cuda":
        return waves * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def tune_key(batch: int, heads: int, width: int, is_fp8: bool, has_topk: bool) -> str:
    """Shape key of wideep_kernels/tuned/<gpu>.json: KV type, sparse or dense, heads, latent width, batch bucket."""
    return f"{'fp8' if is_fp8 else 'bf16'}|{'topk' if has_topk else 'dense'}|h{heads}|d{width}|b{batch_bucket(batch)}"


def mla_decode_triton(q, kv, kv_scale, block_tables, g_lens, block_size: int, sm_scale: float, kv_lora: int,
                      topk_pos=None, win_kv=None, win_valid=None, num_splits: int | None = None,
                      config: dict | None = None, ring=None) -> torch.Tensor:
    """Triton flash-decoding path of mla_decode; num_splits overrides the per-sequence split count,
    config the launch configuration (block_n, num_warps, num_stages, waves, min_tiles; the tuned
    one for this GPU and shape when None, see wideep_kernels/tuning.py)."""
    q_in, topk_pos_in, win_kv_in, win_valid_in, num_splits_in = q, topk_pos, win_kv, win_valid, num_splits
    q, q_rope = q if isinstance(q, tuple) else (q[..., :kv_lora], q[..., kv_lora:])
    b, h, d = q.shape[0], q.shape[1], q.shape[-1] + q_rope.shape[-1]
    rope = q_rope.shape[-1]
    if kv.shape[-1] != d or q.shape[-1] != kv_lora or q_rope.shape[:2] != q.shape[:2]:
        raise ValueError(f"kv width {kv.shape[-1]} and q width {d} must both be kv_lora + rope ({kv_lora} + ...)")
    is_fp8 = kv.dtype == FP8_DTYPE
    if is_fp8 and kv_scale is None:
        raise ValueError("fp8 kv needs kv_scale")
    out = torch.empty(b, h, kv_lora, dtype=q.dtype, device=q.device)
    if b == 0 or h == 0 or kv_lora == 0:
        return out.zero_()
    # any strides but a unit last one: the latent part may be a permuted view from its bmm
    q = q if q.stride(-1) == 1 else q.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 or rope == 0 else q_rope.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    g_lens = g_lens.to(torch.int32).contiguous()
    scale = kv_scale.float().contiguous() if is_fp8 else q  # any pointer when unused

    has_topk = topk_pos is not None
    if has_topk:
        topk_pos = topk_pos.to(torch.int32).contiguous()
        n_cap = topk_pos.shape[1]
    else:
        topk_pos = block_tables
        n_cap = block_tables.shape[1] * block_size
    ring_slots = fresh = write_idx = None
    if ring is not None:
        if win_kv is not None:
            raise ValueError("pass the window as win_kv or as ring, not both")
        win_kv, ring_slots, fresh, write_idx = ring
        if win_kv.dtype != fresh.dtype or win_kv.stride(-1) != 1 or fresh.stride(-1) != 1:
            raise ValueError("ring rows and fresh latents must share a dtype, with unit last stride")
        ring_slots = ring_slots.contiguous()
        write_idx = None if write_idx is None else write_idx.contiguous()
        n_win = win_kv.shape[1] + 1 if win_valid is None else win_valid.shape[1]
        if n_win <= win_kv.shape[1] or (write_idx is not None and n_win != win_kv.shape[1] + 1):
            raise ValueError(f"win_valid has {n_win} entries for a ring of {win_kv.shape[1]}: one fresh latent "
                             f"a row when the kernel writes the ring, at least one otherwise")
    has_window = win_kv is not None and win_kv.shape[1] + (ring is not None) > 0
    if has_window and ring is not None:
        num_win = win_kv.shape[1] + 1 if win_valid is None else win_valid.shape[1]
        if win_valid is None:
            win_valid = torch.ones(b, num_win, dtype=torch.bool, device=q.device)
        win_flags = _flags(win_valid)
    elif has_window:
        if win_kv.dtype == FP8_DTYPE:
            raise ValueError("window keys carry no scale: pass them in bf16/fp16/fp32")
        if win_kv.stride(-1) != 1:
            win_kv = win_kv.contiguous()
        if win_valid is None:
            win_valid = torch.ones(win_kv.shape[:2], dtype=torch.bool, device=q.device)
        win_flags = _flags(win_valid)
        num_win = win_kv.shape[1]
    else:
        win_kv, win_flags, num_win = q, q, 0

    block_c, block_r = _pow2(kv_lora), _pow2(rope)
    block_h = min(_pow2(h), max(16, 16384 // block_c))  # keeps the fp32 accumulator in registers
    head_groups = triton.cdiv(h, block_h)
    block_n, num_warps, num_stages = _tile_config(block_c, block_h, kv.element_size(), q.dtype)
    waves, min_tiles = 2, 4
    if config is None and q.dtype != torch.float32:
        config = tuned_config(q.device, "mla_decode", tune_key(b, h, d, is_fp8, has_topk))
    window_rows = (win_kv,) if has_window else ()
    rows = (kv, *window_rows) + (() if ring is None else (fresh,))
    gluon = gluon_applies(q, kv, config, block_h, window_rows[0] if has_window else None, *rows)
    if (config or {}).get("gluon") and not gluon:
        # a Gluon entry where Gluon cannot run (another Triton, FP8 keys as rows spill): the built-in
        # choice, not that entry's numbers
        config = None
    if config:
        block_n, num_warps, num_stages = config["block_n"], config["num_warps"], config["num_stages"]
        waves, min_tiles = config["waves"], config["min_tiles"]
    # Top-k positions resolved to slots first: 20% less time at batch 64 on the H200, the same at
    # batch 16 (bench.probe_mla). Reloading q per tile: within 1-4%, so off unless a config asks.
    # The Gluon kernel resolves positions itself when its configuration says slots: false.
    slots = has_topk and bool((config or {}).get("slots", True))
    q_reload = bool((config or {}).get("q_reload", False))
    # Keys as the rows of both products (wideep_kernels/mla_decode_rows.py); q_reload has no meaning there.
    split_kernel = _rows_split_kernel if (config or {}).get("keys_rows", False) else _split_kernel
    if gluon:
        split_kernel, block_n, num_warps = _gluon_split_kernel, GLUON_BLOCK_N, (config or {}).get("num_warps", 4)
    if slots:
        resolved = torch.empty(b, n_cap, dtype=torch.int32, device=q.device)
        _resolve_slots_kernel[(triton.cdiv(n_cap, 1024), b)](
            topk_pos, topk_pos.stride(0), block_tables, block_tables.stride(0), block_tables.shape[1] * block_size,
            g_lens, resolved, n_cap, block_size, BLOCK=1024, num_warps=4, **pdl_launch(topk_pos))
        topk_pos = resolved
    if split_kernel is _rows_split_kernel or split_kernel is _gluon_split_kernel:
        # One stage at 64-key tiles hit an illegal address on the H200 (Triton 3.6), with and
        # without a hand-pipelined loop; not understood, so never launched.
        num_stages = max(num_stages, 2) if q.is_cuda and block_n >= 64 else num_stages
        # Global keys (padded to whole tiles), then window keys: tiles dealt to the splits in turn,
        # at most `waves` programs an SM: this kernel's 64-key tiles leave one program an SM (shared
        # memory), so a second partial wave would double its time.
        span = triton.cdiv(n_cap, block_n) * block_n
        tiles = max(1, triton.cdiv(span + num_win, block_n))
        if num_splits is None:
            num_splits = min(_target_programs(q.device, waves) // (b * head_groups), tiles // min_tiles)
        num_splits = max(1, min(num_splits, tiles))
        keys_per_split = triton.cdiv(tiles, num_splits) * block_n
        total_splits = triton.cdiv(tiles * block_n, keys_per_split)
        num_global = span  # the kernel's global_span
    else:
        tiles = triton.cdiv(max(n_cap, 1), block_n)
        if num_splits is None:
            # Enough programs to fill the GPU, but at least min_tiles each so the merge stays cheap.
            num_splits = triton.cdiv(_target_programs(q.device, waves), b * head_groups)
            num_splits = max(1, min(num_splits, triton.cdiv(tiles, min_tiles)))
        num_splits = max(1, min(num_splits, tiles))
        keys_per_split = triton.cdiv(tiles, num_splits) * block_n
        num_global = triton.cdiv(max(n_cap, 1), keys_per_split)
        total_splits = num_global + (1 if has_window else 0)

    # One split a row (prompt chunks, batches past the SM count): the Gluon kernel writes the
    # output itself, without fp32 partials and the merge launch.
    direct = split_kernel is _gluon_split_kernel and total_splits == 1
    if direct:
        part_acc = part_m = part_l = out
    else:
        part_acc = torch.empty(b, total_splits, h, kv_lora, dtype=torch.float32, device=q.device)
        part_m = torch.empty(b, total_splits, h, dtype=torch.float32, device=q.device)
        part_l = torch.empty(b, total_splits, h, dtype=torch.float32, device=q.device)
    # The interpreter (Triton 3.9) computes bf16 dots wrongly: it gets fp32 operands instead.
    upcast = q.device.type == "cpu" and q.dtype == torch.bfloat16
    prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    args = (
        q, q.stride(0), q.stride(1), q_rope, q_rope.stride(0), q_rope.stride(1),
        kv, kv.stride(0), scale,
        block_tables, block_tables.stride(0), block_tables.shape[1] * block_size, g_lens,
        topk_pos, topk_pos.stride(0), n_cap,
        win_kv, win_kv.stride(0) if has_window else 0, win_kv.stride(1) if has_window else 0,
        win_flags, win_flags.stride(0) if has_window else 0, num_win,
        *((ring_slots, fresh, fresh.stride(0), win_kv.shape[1], q if write_idx is None else write_idx)
          if ring is not None else (q, q, 0, 0, q)),
        part_acc, part_m, part_l,
        h, kv_lora, rope, block_size, keys_per_split, num_global, sm_scale * _LOG2E)
    consts = dict(BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_N=block_n, IS_FP8=is_fp8,
                  HAS_TOPK=has_topk, HAS_WINDOW=has_window, RING=ring is not None, PREC=prec, SLOTS=slots,
                  Q_RELOAD=q_reload, UPCAST=upcast, RING_WRITE=ring is not None and write_idx is not None,
                  num_warps=num_warps, **pdl_launch(q))
    grid = (total_splits, head_groups, b)
    if split_kernel is _gluon_split_kernel:
        try:
            _gluon_split_kernel[grid](*args, **consts, DIRECT=direct)
        except Exception as e:  # a Triton whose Gluon differs: warn once, then the Triton kernel
            _unusable.add("mla_decode_gluon")
            log.warning("Gluon MLA decode kernel failed here (%s: %s); using the Triton kernel from now on",
                        type(e).__name__, e)
            return mla_decode_triton(q_in, kv, kv_scale, block_tables, g_lens, block_size, sm_scale, kv_lora,
                                     topk_pos_in, win_kv_in, win_valid_in, num_splits_in, config, ring)
    else:
        split_kernel[grid](*args, **consts, num_stages=num_stages)
    if direct:
        return out
    # One program per (sequence, head) over the whole latent: 3.3 us at batch 64 on the H200
    # summing four splits a step, where 128-column programs and 16-split steps took 15 us
    # (bench.probe_mla). With few programs (batch 1-16 at 16 heads, 35 splits) each program's
    # serial loop is the time, and sixteen splits a step measured 4.8-5.6 us against 7.1-7.6 us
    # for four. Chosen by batch bucket, so warm-up (one run per bucket) builds every value.
    few_programs = batch_bucket(b) * h <= 256
    _merge_kernel[(1, h, b)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1),
        total_splits, h, kv_lora,
        BLOCK_SC=16 if few_programs else 4, BLOCK_CC=block_c, num_warps=4, **pdl_launch(part_acc))
    return out


def mla_decode(q, kv, kv_scale, block_tables, g_lens, block_size: int, sm_scale: float, kv_lora: int,
               topk_pos=None, win_kv=None, win_valid=None, ring=None) -> torch.Tensor:
    """Decode attention of one query per sequence over paged latents (+ window keys).

    q [B,H,D] bf16/fp16/fp32, or the pair (q_lat [B,H,kv_lora], q_rope [B,H,D-kv_lora]) so that
    the caller need not concatenate them; kv [S,D] bf16/fp32, or float8_e4m3fn with kv_scale [S] fp32 (key = kv * scale);
    block_tables [B,M] int32; g_lens [B] int32; topk_pos [B,K] int32 or None (-1 = no entry);
    win_kv [B,Wk,D] or None, win_valid [B,Wk] bool or None (all valid).
    ring = (ring_kv [R,W,D], ring_slots [B] int64, fresh [B,D], write_idx [B] int64) instead of
    win_kv: the window is ring_kv[ring_slots[b]] then fresh[b] (win_valid [B,W+1]), and fresh[b]
    is written to ring_kv[ring_slots[b], write_idx[b]] (its entry must be masked in win_valid).
    With write_idx None (prompt-chunk rows), nothing is written and win_valid [B,W+F] may name F
    fresh latents: fresh[b], fresh[b-1], ..., fresh[b-F+1] (those past row 0 masked).
    Softmax in fp32 of (q . key) * sm_scale over the union of global and window keys;
    returns sum p * key[:kv_lora] as [B,H,kv_lora] in q's dtype, zeros for a row with no key.
    The Triton path multiplies in q's precision (keys and probabilities rounded to q's dtype,
    fp32 accumulation); the reference does all of it in fp32.
    """
    args = (q, kv, kv_scale, block_tables, g_lens, block_size, sm_scale, kv_lora, topk_pos, win_kv, win_valid)
    if triton is not None and triton_ok(q[0] if isinstance(q, tuple) else q):
        return mla_decode_triton(*args, ring=ring)
    return mla_decode_reference(*args, ring=ring)




def warm_up(heads: int, kv_lora: int, rope: int, dtype: torch.dtype, kv_dtype: torch.dtype, device,
            max_batch: int, topk: int | None, window: int | None, block_size: int = 64) -> None:
    """Run the kernel once per batch bucket, in the variants the engine uses (top-k and dense
    rows; the window read in place from the ring, written as decode does or not as prefill
    chunks do; this KV type), on dummy inputs: each bucket may have its own tuned launch
    configuration (wideep_kernels/tuning.py), and a Triton build met mid-serving would stall every
    running request for a second or so."""
    d = kv_lora + rope
    buckets = sorted({batch_bucket(b) for b in BATCH_BUCKETS if b <= max_batch} | {batch_bucket(max_batch)})
    for b in buckets:
        q = torch.zeros(b, heads, d, dtype=dtype, device=device)
        kv = torch.zeros(b * block_size, d, dtype=dtype, device=device).to(kv_dtype)
        scale = torch.ones(b * block_size, dtype=torch.float32, device=device) if kv_dtype == FP8_DTYPE else None
        tables = torch.arange(b, dtype=torch.int32, device=device)[:, None]
        lens = torch.full((b,), block_size, dtype=torch.int32, device=device)
        ring = valid = None
        if window:
            ring = (torch.zeros(b, window, d, dtype=dtype, device=device), torch.arange(b, device=device),
                    torch.zeros(b, d, dtype=dtype, device=device), torch.zeros(b, dtype=torch.long, device=device))
            valid = torch.ones(b, window + 1, dtype=torch.bool, device=device)
        modes = [None] + ([torch.full((b, topk), -1, dtype=torch.int32, device=device)] if topk else [])
        for topk_pos in modes:
            mla_decode(q, kv, scale, tables, lens, block_size, 1.0, kv_lora, topk_pos=topk_pos,
                       win_valid=valid, ring=ring)
            if window:  # prompt-chunk rows: the ring unwritten, a window's worth of fresh latents
                mla_decode(q, kv, scale, tables, lens, block_size, 1.0, kv_lora, topk_pos=topk_pos,
                           win_valid=torch.ones(b, 2 * window, dtype=torch.bool, device=device),
                           ring=ring[:3] + (None,))


__all__ = ["mla_decode", "mla_decode_reference", "mla_decode_triton", "warm_up"]
