"""Fused MoE expert compute: a grouped GEMM with SwiGLU over (token, slot, weight) pairs.

    out[t] = sum over pairs p with token_of[p] == t of
             weight_of[p] * w2[s] @ (silu(w13[s, :I] @ x[t]) * (w13[s, I:] @ x[t])),  s = slot_of[p]

with w13 [S, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and w2 [S, H, I], in the activations' dtype or
in block FP8 (float8 e4m3 with ExpertScales: each weight tile read as one byte an element and
converted in registers, decode tiles scaling its partial products and prompt-chunk tiles the tile
itself; activations stay 16-bit). With `act_fp8` the activations are FP8 too, per token per 128
columns (DeepSeek-V3's inference scheme, fp8_blocks.quantize_act_groups): x is quantized once a
token by a launch of its own, the SwiGLU output by the gate-up kernel as it stores it, and the
products run on FP8 tensor cores, each k step's scaled by the row's and the column's scales.
token_of may be None
when the pairs are token-major, k per token (p // k is the token): the router's layout, for
which the kernels derive the token themselves instead of reading a tensor two launches built.
A pair whose slot is -1 is dropped: expert parallelism hands every rank the whole group's
pairs, fixed in number, and a rank computes only those of its own slots (no compaction, which
would read a count back to the host).

The Triton path sorts pairs by slot and pads every slot's rows to a whole row tile (moe_align.py), so each
tile of the padded layout belongs to exactly one slot and reads one expert's weights. All
buffers are sized for the worst case from shapes alone, so nothing is read back to the host
and the whole call can be captured in a CUDA graph. A token's pairs are summed with fp32
atomics, so the last bits of the sum may vary from run to run (as with index_add_ on CUDA).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import kernel_or_reference, triton_ok
from .fp8_blocks import ExpertScales, check_expert_scales
from .moe_align import AlignedPairs, _jit, align_pairs_triton
from .moe_fp8_tiles import _fp8_act, _fp8_operand, _fp8_weights, _quantize_rows_kernel
from .moe_reference import (check_act_fp8, check_shared, check_shared_rows, fused_experts_reference,  # noqa: F401 (the API)
                            pairs_per_token, token_major)

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .rmsnorm import cast_rne
except ImportError:  # the reference path still works without Triton
    triton = tl = None


# FP8 x FP8 products: Hopper's tensor cores sum them in less than fp32 (DeepSeek-V3's report: about
# 14 bits). 0: each k step's sum (one 128-column activation group) goes into the fp32 accumulator
# as it is scaled, DeepSeek-V3's own promotion interval; n > 0 promotes every n k inside a step
# as well. On an H200, promoting every 32 k cost 11-17% of the FP8 prompt-chunk MoE time (bench
# layer at 2048 tokens: 698 against 618 us) for a layer error against the exact-sum reference of
# 0.0117 against 0.0119 (RESULTS.md, twenty-sixth and twenty-seventh sessions).
FP8_PRECISE_ACC = 0


# ---------------------------------------------------------------- Triton kernels

def _tile_rows(token_ptr, row_pair_ptr, tile_slot_ptr, num_slots, num_tiles, shared_first, shared_end,
               BLOCK_M: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr, SHARED: tl.constexpr):
    """A tile's slot, whether it is one of the shared expert's tiles (after the routed ones: their
    row j is token shared_first + j, weight 1, up to shared_end), its pairs (-1: none) and its
    rows' tokens."""
    tile = tl.program_id(0)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    routed = tile < num_tiles
    one = tl.arange(0, 1)  # a masked load of one value, as a vector (a scalar mask is not portable)
    slot = tl.sum(tl.load(tile_slot_ptr + tile + one, mask=tile + one < num_tiles, other=0), axis=0).to(tl.int64)
    pair = tl.load(row_pair_ptr + rows, mask=rows < num_tiles * BLOCK_M, other=-1)
    is_pair = pair >= 0
    if PAIRS_PER_TOKEN > 0:  # token-major pairs: no token tensor to read
        token = tl.where(is_pair, pair // PAIRS_PER_TOKEN, 0).to(tl.int64)
    else:
        token = tl.load(token_ptr + pair, mask=is_pair, other=0).to(tl.int64)
    if SHARED:
        is_shared = tile >= num_tiles
        shared_token = shared_first + (tile - num_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        token = tl.where(is_shared, shared_token, token).to(tl.int64)
        is_pair = tl.where(is_shared, shared_token < shared_end, is_pair)
    else:
        is_shared = tile < 0
    skip = routed & (slot >= num_slots)
    return slot, is_shared, skip, rows, pair, is_pair, token


if triton is not None:  # called from the kernels below, so built with them
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    _tile_rows = triton.jit(_tile_rows)


def _gate_up_kernel(x_ptr, w13_ptr, shared_w13_ptr, act_ptr, token_ptr, row_pair_ptr, tile_slot_ptr,
                    H, I, num_slots, num_tiles, shared_first, shared_end, stride_xt, zero_ptr, zero_count,
                    x_scale_ptr, act_scale_ptr,
                    scale_ptr, shared_scale_ptr, scale_rows, scale_cols,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr,
                    SHARED: tl.constexpr, SCALE_N: tl.constexpr = 0, SCALE_K: tl.constexpr = 0,
                    DEQUANT_TILE: tl.constexpr = 0, ACT_FP8: tl.constexpr = 0, FP8_ACC: tl.constexpr = None,
                    ACT_DTYPE: tl.constexpr = None, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # One program: BLOCK_M padded rows (one slot) x BLOCK_N columns of both gate and up.
    # First its share of the down kernel's fp32 sum, zeroed here instead of by a launch of its own.
    programs = tl.num_programs(0) * tl.num_programs(1)
    share = tl.cdiv(zero_count, programs)
    first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * share
    for i in range(0, share, 256):
        idx = first + i + tl.arange(0, 256)
        tl.store(zero_ptr + idx, tl.zeros([256], dtype=tl.float32), mask=(idx < first + share) & (idx < zero_count))
    slot, is_shared, skip, rows, pair, is_pair, token = _tile_rows(
        token_ptr, row_pair_ptr, tile_slot_ptr, num_slots, num_tiles, shared_first, shared_end, BLOCK_M,
        PAIRS_PER_TOKEN, SHARED)
    if skip:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    # w13[slot] is [2I, H] row-major; read it as [BLOCK_K, BLOCK_N] tiles (k fastest in memory).
    w_offs = cols[None, :].to(tl.int64) * H + ks[:, None]
    gate_ptrs = w13_ptr + slot * 2 * I * H + w_offs
    if SHARED:
        gate_ptrs = tl.where(is_shared, shared_w13_ptr + w_offs, gate_ptrs)
    up_ptrs = gate_ptrs + I * H
    if SCALE_N > 0:
        # Block FP8 (ExpertScales): a column's scale row, the gate's row blocks before the up's.
        s_offs = (cols // SCALE_N).to(tl.int64) * scale_cols
        gate_scale_ptrs = scale_ptr + slot * 2 * scale_rows * scale_cols + s_offs
        if SHARED:
            gate_scale_ptrs = tl.where(is_shared, shared_scale_ptr + s_offs, gate_scale_ptrs)
        up_scale_ptrs = gate_scale_ptrs + scale_rows * scale_cols
    acc_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = ks + k0 < H
        a = tl.load(x_ptrs, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if SCALE_N > 0:
            # BLOCK_K divides SCALE_K: one scale per column over this step's k range
            sg = tl.load(gate_scale_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
            su = tl.load(up_scale_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
            if ACT_FP8:  # x quantized already (quantize_rows); BLOCK_K is its group: one scale a row
                sa = tl.load(x_scale_ptr + token * tl.cdiv(H, BLOCK_K) + k0 // BLOCK_K, mask=is_pair, other=0.0)
                sg, su = sa[:, None] * sg[None, :], sa[:, None] * su[None, :]
            else:
                wg = _fp8_weights(wg, sg, DEQUANT_TILE, a.dtype, DOT_FP32)
                wu = _fp8_weights(wu, su, DEQUANT_TILE, a.dtype, DOT_FP32)
                if not DEQUANT_TILE:
                    a = _fp8_operand(a)
        if DOT_FP32:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        if ACT_FP8 and not DOT_FP32:  # e4m3 x e4m3 on the tensor cores, each step promoted to fp32
            acc_gate += tl.dot(a, wg, max_num_imprecise_acc=FP8_ACC) * sg
            acc_up += tl.dot(a, wu, max_num_imprecise_acc=FP8_ACC) * su
        elif ACT_FP8:
            acc_gate += tl.dot(a, wg, input_precision=PRECISION) * sg
            acc_up += tl.dot(a, wu, input_precision=PRECISION) * su
        elif SCALE_N > 0 and not DEQUANT_TILE:
            acc_gate += tl.dot(a, wg, input_precision=PRECISION) * sg[None, :]
            acc_up += tl.dot(a, wu, input_precision=PRECISION) * su[None, :]
        else:
            acc_gate = tl.dot(a, wg, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(a, wu, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    # Padding rows hold zeros (their x rows were masked to 0), so the down kernel may read them.
    act_ptrs = act_ptr + rows[:, None].to(tl.int64) * I + cols[None, :]
    if ACT_FP8:
        # BLOCK_N is one activation group: the down kernel's input quantized here, once a row, from
        # its 16-bit value (what the 16-bit activations would store)
        if DOT_FP32:
            act16 = cast_rne(act, ACT_DTYPE).to(tl.float32)
        else:
            act16 = act.to(ACT_DTYPE).to(tl.float32)
        q, sa = _fp8_act(act16, DOT_FP32)
        tl.store(act_scale_ptr + rows.to(tl.int64) * tl.cdiv(I, BLOCK_N) + tl.program_id(1), sa)
        tl.store(act_ptrs, q, mask=col_ok[None, :])
    else:
        if DOT_FP32:  # the interpreter: rounded to nearest even by hand, as the GPU's cast does
            act = cast_rne(act, act_ptr.dtype.element_ty)
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=col_ok[None, :])


def _down_kernel(act_ptr, w2_ptr, shared_w2_ptr, out_ptr, token_ptr, weight_ptr, row_pair_ptr, tile_slot_ptr,
                 H, I, num_slots, num_tiles, shared_first, shared_end, stride_ot, num_pairs, act_scale_ptr,
                 scale_ptr, shared_scale_ptr, scale_rows, scale_cols,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, PAIRS_PER_TOKEN: tl.constexpr,
                 SHARED: tl.constexpr, SCALE_N: tl.constexpr = 0, SCALE_K: tl.constexpr = 0,
                 DEQUANT_TILE: tl.constexpr = 0, ACT_FP8: tl.constexpr = 0, FP8_ACC: tl.constexpr = None,
                 PAIR_ROWS: tl.constexpr = 0, PDL: tl.constexpr = 0):
    pdl_enter(PDL)
    # One program: BLOCK_M padded rows (one slot) x BLOCK_N hidden columns, added into fp32 out
    # (PAIR_ROWS: stored as each pair's own row of out, for _sum_pairs_kernel).
    slot, is_shared, skip, rows, pair, is_pair, token = _tile_rows(
        token_ptr, row_pair_ptr, tile_slot_ptr, num_slots, num_tiles, shared_first, shared_end, BLOCK_M,
        PAIRS_PER_TOKEN, SHARED)
    if skip:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * I + ks[None, :]
    w_offs = cols[None, :].to(tl.int64) * I + ks[:, None]
    w_ptrs = w2_ptr + slot * H * I + w_offs
    if SHARED:
        w_ptrs = tl.where(is_shared, shared_w2_ptr + w_offs, w_ptrs)
    if SCALE_N > 0:
        s_offs = (cols // SCALE_N).to(tl.int64) * scale_cols
        scale_ptrs = scale_ptr + slot * scale_rows * scale_cols + s_offs
        if SHARED:
            scale_ptrs = tl.where(is_shared, shared_scale_ptr + s_offs, scale_ptrs)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = ks + k0 < I
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALE_N > 0:
            scale = tl.load(scale_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
            if ACT_FP8:  # quantized by the gate-up kernel, one group a k step
                sa = tl.load(act_scale_ptr + rows.to(tl.int64) * tl.cdiv(I, BLOCK_K) + k0 // BLOCK_K)
                scale = sa[:, None] * scale[None, :]
            else:
                w = _fp8_weights(w, scale, DEQUANT_TILE, a.dtype, DOT_FP32)
                if not DEQUANT_TILE:
                    a = _fp8_operand(a)
        if DOT_FP32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if ACT_FP8 and not DOT_FP32:
            acc += tl.dot(a, w, max_num_imprecise_acc=FP8_ACC) * scale
        elif ACT_FP8:
            acc += tl.dot(a, w, input_precision=PRECISION) * scale
        elif SCALE_N > 0 and not DEQUANT_TILE:
            acc += tl.dot(a, w, input_precision=PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if PAIR_ROWS:
        # Many rows a slot (pick_config): each pair's output unweighted, rounded as the MLP's own
        # output would be; a second pass sums a token's rows (row num_pairs + t: its shared expert).
        dest = tl.where(is_shared, num_pairs + token, pair).to(tl.int64)
        if DOT_FP32:
            acc = cast_rne(acc, out_ptr.dtype.element_ty)
        tl.store(out_ptr + dest[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=is_pair[:, None] & col_ok[None, :])
    else:
        route_weight = tl.load(weight_ptr + pair, mask=pair >= 0, other=0.0).to(tl.float32)
        if SHARED:
            route_weight = tl.where(is_shared, 1.0, route_weight)
        acc = acc * route_weight[:, None]
        # A token's k pairs land in different tiles: combine them with fp32 atomics (order-free
        # sum, like index_add_ on CUDA). Few rows a slot make few atomics; past that they cost more
        # than a row a pair and a second pass (PAIR_ROWS).
        out_ptrs = out_ptr + token[:, None] * stride_ot + cols[None, :]
        tl.atomic_add(out_ptrs, acc, mask=is_pair[:, None] & col_ok[None, :])


def _sum_pairs_kernel(rows_ptr, weight_ptr, slot_ptr, add_ptr, out_ptr, H, num_pairs, shared_first, shared_end,
                      PAIRS_PER_TOKEN: tl.constexpr, SHARED: tl.constexpr, HAS_ADD: tl.constexpr,
                      DROPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """out[t] = sum_j rows[t k + j] weight[t k + j] (+ rows[num_pairs + t], the shared expert, for
    t in [shared_first, shared_end)) in fp32, in j's order; with add, rounded to out's dtype, plus add,
    rounded again (as _round_add_kernel).
    DROPS: pairs of slot -1 were never computed (their rows hold anything) and add nothing."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(PAIRS_PER_TOKEN):
        pair = token * PAIRS_PER_TOKEN + j
        weight = tl.load(weight_ptr + pair).to(tl.float32)
        if DROPS:
            if tl.load(slot_ptr + pair) >= 0:
                acc += tl.load(rows_ptr + pair * H + cols, mask=ok, other=0.0).to(tl.float32) * weight
        else:
            acc += tl.load(rows_ptr + pair * H + cols, mask=ok, other=0.0).to(tl.float32) * weight
    if SHARED:
        if (token >= shared_first) & (token < shared_end):
            acc += tl.load(rows_ptr + (num_pairs + token) * H + cols, mask=ok, other=0.0).to(tl.float32)
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if HAS_ADD:
        a = cast_rne(acc, DTYPE).to(tl.float32)
        acc = a + tl.load(add_ptr + token * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + cols, cast_rne(acc, DTYPE), mask=ok)


def _round_add_kernel(acc_ptr, add_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    """out = acc (fp32) rounded to out's dtype, plus add, rounded again: torch's `acc.to(d) + add`
    bit for bit, in one launch instead of a cast and an add."""
    pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    a = cast_rne(tl.load(acc_ptr + i, mask=ok, other=0.0), DTYPE).to(tl.float32)
    b = tl.load(add_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, cast_rne(a + b, DTYPE), mask=ok)


class MoEGemmConfig(NamedTuple):
    block_m: int
    gate_up: tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages
    down: tuple[int, int, int, int]
    # a row of output a pair, summed by a second pass, instead of fp32 atomics (token-major pairs)
    pair_rows: bool = False


def pick_config(num_pairs: int, num_slots: int, dtype: torch.dtype, act_fp8: bool = False) -> MoEGemmConfig:
    """Fixed tile shapes by the mean rows per slot: thin tiles for decode (weight-bandwidth
    bound, little padding), wider ones for prompt chunks (compute bound). The chunk shapes are
    `python -m bench.probe_moe --prefill`'s winners on an H200 (bench model, 512 and 2048 tokens):
    rows of 64 beat 128 even at 192 rows a slot, and 8 warps beat 4. FP8 activations keep the
    decode row tiles (the router lays out one token's pairs for them) and take k steps of one
    activation group."""
    rows_per_slot = num_pairs / max(num_slots, 1)
    if rows_per_slot <= 16:
        cfg = MoEGemmConfig(16, (64, 128, 4, 4), (64, 128, 4, 4))
    elif rows_per_slot <= 32:
        cfg = MoEGemmConfig(32, (64, 128, 4, 4), (64, 128, 4, 4))
    elif rows_per_slot <= 128:
        cfg = MoEGemmConfig(64, (64, 64, 8, 4), (64, 64, 8, 3))
    else:
        cfg = MoEGemmConfig(64, (256, 64, 8, 3), (128, 32, 8, 4))
    if dtype == torch.float8_e4m3fn and 4 < rows_per_slot <= 16:
        # one byte a weight: wider column tiles win from a few rows a slot (bench.probe_moe --fp8, H200)
        cfg = cfg._replace(gate_up=(128, 128, 4, 3), down=(128, 128, 4, 3))
    elif dtype == torch.float8_e4m3fn and rows_per_slot > 128:
        # each weight tile dequantized once for twice the rows: 662 against 807 us at 2048 tokens
        # (bench.probe_moe --fp8 --prefill, H200)
        cfg = MoEGemmConfig(128, (128, 128, 8, 3), (64, 64, 4, 3))
    if act_fp8 and cfg.block_m >= 64:
        # both operands one byte, nothing converted: rows of 64 at every chunk size (rows of 128
        # took 1392 us at 2048 tokens, bench.probe_moe --fp8 --act-fp8 on an H200)
        cfg = MoEGemmConfig(64, (128, 128, 8, 3), (128, 128, 8, 3))
    if cfg.block_m >= 32:
        # from 17 rows a slot a pair's own output row and a second pass beat fp32 atomics: bench
        # layer 193 against 207 us at 256 tokens, 458 against 507 at 2048 (bench.probe_moe
        # --pair-rows-ab, H200); at 16 rows a slot or fewer they are within 1%
        cfg = cfg._replace(pair_rows=True)
    if dtype == torch.float32:  # twice the bytes per stage: fewer stages (and gate-up columns) to fit shared memory
        cfg = cfg._replace(gate_up=(min(cfg.gate_up[0], 128),) + cfg.gate_up[1:3] + (2,), down=cfg.down[:3] + (2,))
    return cfg


def act_fp8_pays(num_pairs: int, num_slots: int) -> bool:
    """Whether FP8 activations beat 16-bit ones beside FP8 weights for these pairs: from 17 rows a
    slot (row tiles of 32 and up). On an H200 there they were 1.1-1.5x faster (bench.probe_moe
    --fp8 --act-fp8); in decode tiles of 16 rows within a few percent either way."""
    return pick_config(num_pairs, num_slots, torch.float8_e4m3fn).block_m >= 32


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, token_of: torch.Tensor | None,
                         slot_of: torch.Tensor, weight_of: torch.Tensor,
                         config: MoEGemmConfig | None = None, add=None,
                         shared: tuple | None = None, fp32_out: bool = False,
                         aligned: AlignedPairs | None = None, scales: ExpertScales | None = None,
                         act_fp8: bool = False, live_pairs: int | None = None,
                         shared_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """fused_experts through the two Triton kernels (no host sync; CUDA-graph capturable)."""
    num_tokens, hidden = x.shape
    num_slots, two_i, _ = w13.shape
    inter = two_i // 2
    slot_of = slot_of.contiguous()
    num_pairs = slot_of.numel()
    pending, add = (add, None) if callable(add) else (None, add)
    shared_first, shared_end = check_shared_rows(shared_rows, num_tokens)
    if num_tokens == 0 or (num_pairs == 0 and (shared is None or shared_first == shared_end)):
        add = pending() if pending is not None else add
        return torch.zeros_like(x) if add is None else add.clone()
    check_expert_scales(w13, w2, scales)
    group = check_act_fp8(act_fp8, scales)
    if shared is not None:
        shared = check_shared(shared, w13, w2, scales)
    k = pairs_per_token(num_tokens, num_pairs) if token_of is None and num_pairs else 0
    drops = live_pairs is not None
    cfg = config or pick_config(live_pairs if drops else num_pairs, num_slots, w13.dtype, act_fp8)
    pair_rows = cfg.pair_rows and k > 0
    if pair_rows:  # a row a pair (then one a token for the shared expert), each written once
        out = torch.empty(num_pairs + (num_tokens if shared is not None else 0), hidden, dtype=x.dtype,
                          device=x.device)
    else:  # the fp32 output, which the down kernel adds into, is zeroed by the gate-up launch
        out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if aligned is None:
        aligned = align_pairs_triton(slot_of, num_slots, cfg.block_m)
    elif aligned.row_pair.numel() != aligned.tile_slot.numel() * cfg.block_m:
        raise ValueError(f"the pairs' layout has tiles of {aligned.row_pair.numel() // max(1, aligned.tile_slot.numel())} "
                         f"rows; these kernels take {cfg.block_m} (pick_config)")
    num_tiles = aligned.tile_slot.numel()
    # The shared expert's rows follow the routed tiles, one per token it takes (see _tile_rows).
    tiles = num_tiles + (triton.cdiv(shared_end - shared_first, cfg.block_m) if shared is not None else 0)
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    shared_w13, shared_w2, shared_scales = shared if shared is not None else (w13, w2, scales)  # read with SHARED
    # FP8 weights are converted in the kernels: the activations keep their 16-bit dtype
    compute = x.dtype if scales is not None else w13.dtype
    xw = x.to(compute).contiguous()
    token_of = slot_of if token_of is None else token_of.contiguous()  # not read when k > 0
    weight_of = weight_of.contiguous()
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584): on CPU
    # the operands go up to fp32 first, where products of bf16 values are exact.
    dot_fp32 = not x.is_cuda
    # fp32 operands get IEEE products like the reference's F.linear (TF32 would cost ~1e-3 relative).
    precision = "ieee" if dot_fp32 or compute == torch.float32 else "tf32"

    act = torch.empty(tiles * cfg.block_m, inter, dtype=torch.float8_e4m3fn if group else compute, device=x.device)
    # FP8 activations: x quantized once a token here, the SwiGLU output by the gate-up kernel
    x_scale = act_scale = out  # not read without them
    if group:
        xq = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        x_scale = torch.empty(num_tokens, triton.cdiv(hidden, group), dtype=torch.float32, device=x.device)
        _jit(_quantize_rows_kernel, "K")[(num_tokens, x_scale.shape[1])](
            xw, xq, x_scale, hidden, xw.stride(0), GROUP=group, INTERPRETED=dot_fp32, num_warps=1, **pdl_launch(xw))
        xw = xq
        act_scale = torch.empty(act.shape[0], triton.cdiv(inter, group), dtype=torch.float32, device=x.device)
    plain = ("num_tiles", "shared_first", "shared_end", "zero_count")
    if scales is None:
        scaled = dict(scale_ptr=w13, shared_scale_ptr=w13, scale_rows=0, scale_cols=0)  # not read
        gate_up_scaled = down_scaled = scaled
    else:
        rows, cols = scales.block
        gate_up_scaled = dict(scale_ptr=scales.w13.contiguous(), shared_scale_ptr=shared_scales.w13.contiguous(),
                              scale_rows=scales.w13.shape[-2] // 2, scale_cols=scales.w13.shape[-1],
                              SCALE_N=rows, SCALE_K=cols)
        down_scaled = dict(scale_ptr=scales.w2.contiguous(), shared_scale_ptr=shared_scales.w2.contiguous(),
                           scale_rows=scales.w2.shape[-2], scale_cols=scales.w2.shape[-1], SCALE_N=rows, SCALE_K=cols)
    # A k step of the scaled kernels stays inside one scale block (cols: a power of two), and with
    # FP8 activations is one activation group.
    fit_k = (lambda bk: bk) if scales is None else (lambda bk: group or min(bk, scales.block[1]))

    def launch(dequant_tile: int) -> None:
        # Both launches from scratch: the gate-up launch zeroes the sum the down launch adds into.
        block_n, block_k, warps, stages = cfg.gate_up
        block_n = group or block_n  # FP8 activations: a program's columns are one group of its output
        _jit(_gate_up_kernel, *plain)[(tiles, triton.cdiv(inter, block_n))](
            xw, w13, shared_w13, act, token_of, aligned.row_pair, aligned.tile_slot,
            hidden, inter, num_slots, num_tiles, shared_first, shared_end, xw.stride(0), out,
            0 if pair_rows else out.numel(),
            x_scale, act_scale,
            **gate_up_scaled, ACT_DTYPE=_TL_DTYPES[compute],
            BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=fit_k(block_k), PRECISION=precision, DOT_FP32=dot_fp32,
            PAIRS_PER_TOKEN=k, SHARED=shared is not None, DEQUANT_TILE=dequant_tile, ACT_FP8=bool(group),
            FP8_ACC=FP8_PRECISE_ACC or None, num_warps=warps, num_stages=stages, **pdl_launch(xw))
        block_n, block_k, warps, stages = cfg.down
        _jit(_down_kernel, *plain, "num_pairs")[(tiles, triton.cdiv(hidden, block_n))](
            act, w2, shared_w2, out, token_of, weight_of, aligned.row_pair, aligned.tile_slot,
            hidden, inter, num_slots, num_tiles, shared_first, shared_end, out.stride(0), num_pairs, act_scale,
            **down_scaled,
            BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=fit_k(block_k), PRECISION=precision, DOT_FP32=dot_fp32,
            PAIRS_PER_TOKEN=k, SHARED=shared is not None, DEQUANT_TILE=dequant_tile, ACT_FP8=bool(group),
            FP8_ACC=FP8_PRECISE_ACC or None, PAIR_ROWS=pair_rows, num_warps=warps, num_stages=stages,
            **pdl_launch(act))

    if scales is not None and cfg.block_m >= 64 and not group:
        # Prompt-chunk row tiles dequantize the FP8 weight tile, so the MMAs chain in one
        # accumulator; decode tiles scale each product (fewer operations a weight for few rows).
        # The products-scaled variant stands in should this one fail to build on some GPU.
        kernel_or_reference("moe_fp8_dequant_tile", lambda: launch(1), lambda: launch(0))
    else:
        launch(0)
    if pending is not None:
        add = pending()
    if add is not None and (add.shape != (num_tokens, hidden) or add.dtype != x.dtype):
        raise ValueError(f"add must be [{num_tokens}, {hidden}] {x.dtype}, got {list(add.shape)} {add.dtype}")
    if pair_rows:
        summed = torch.empty(num_tokens, hidden, dtype=torch.float32 if fp32_out and add is None else x.dtype,
                             device=x.device)
        block = 1024
        _jit(_sum_pairs_kernel, "num_pairs", "shared_first", "shared_end")[(num_tokens, triton.cdiv(hidden, block))](
            out, weight_of, slot_of, summed if add is None else add.contiguous(), summed, hidden, num_pairs,
            shared_first, shared_end,
            PAIRS_PER_TOKEN=k, SHARED=shared is not None, HAS_ADD=add is not None, DROPS=drops, BLOCK=block,
            num_warps=4, **pdl_launch(out))
        return summed
    if add is None:
        return out if fp32_out else out.to(x.dtype)
    summed = torch.empty(add.shape, dtype=add.dtype, device=add.device)  # written as contiguous
    block = 1024
    _jit(_round_add_kernel, "n")[(triton.cdiv(out.numel(), block),)](
        out, add.contiguous(), summed, out.numel(), BLOCK=block, num_warps=4, **pdl_launch(out))
    return summed


# ---------------------------------------------------------------- dispatcher

def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, token_of: torch.Tensor | None,
                  slot_of: torch.Tensor, weight_of: torch.Tensor, add=None,
                  shared: tuple | None = None, fp32_out: bool = False,
                  aligned: AlignedPairs | None = None, scales: ExpertScales | None = None,
                  act_fp8: bool = False, live_pairs: int | None = None,
                  shared_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Routed experts over pairs: x [T, H], w13 [S, 2I, H], w2 [S, H, I], token_of / slot_of [P]
    int64 (token_of None: token-major pairs, P / T per token), weight_of [P] float -> [T, H] in
    x's dtype (see the module docstring for the sum).
    - `shared` (w13 [2I, H], w2 [H, I]): a shared expert every token passes through with weight 1,
      summed with the routed ones in fp32 (its weight read once, in the same two launches); with
      FP8 routed experts, FP8 itself with a third item, its ExpertScales.
    - `shared_rows` (first, end): only these tokens pass through the shared expert (expert
      parallelism: a rank's own rows among the group's gathered ones); all when None.
    - `scales`: w13 and w2 are block FP8 (wideep_kernels/fp8_blocks.py's layout).
    - `act_fp8` (with `scales`): the activations into both projections are FP8 too, per token per
      128 columns (fp8_blocks.quantize_act_groups), and the products run on FP8 tensor cores.
    - `fp32_out`: without `add`, the Triton path may return the fp32 sum unrounded, for a consumer
      that rounds it itself (add_rms_norm does, in its own launch); other paths round.
    - `add` [T, H]: added to the result as `out + add` would. It may be a function returning it,
      called after the GEMMs are launched: a stream computing it meanwhile is waited for only then.
    - `aligned`: the pairs' layout already made (the routing kernel makes it for one token, with
      pick_config's block_m); otherwise the Triton path makes it (align_pairs).
    - `live_pairs`: some pairs may have slot -1 and are dropped (expert parallelism: another
      rank's), about this many are not; it picks the tiles in place of the pair count.
    Triton where it can run (CUDA, or CPU under TRITON_INTERPRET=1), the reference elsewhere."""
    if triton is not None and triton_ok(x):
        return fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of, add=add, shared=shared,
                                    fp32_out=fp32_out, aligned=aligned, scales=scales, act_fp8=act_fp8,
                                    live_pairs=live_pairs, shared_rows=shared_rows)
    out = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of, shared=shared, scales=scales,
                                  act_fp8=act_fp8, shared_rows=shared_rows)
    return out if add is None else out + (add() if callable(add) else add)
