"""FP8 pieces of the fused MoE expert kernels (wideep_kernels/moe_gemm.py): e4m3 weight tiles and
16-bit activations made ready for the products, activations quantised per row and group in
registers, and the launch that quantises a step's input rows (fp8_blocks.quantize_act_groups)."""
from __future__ import annotations

from .fp8_blocks import ACT_AMAX_FLOOR, FP8_MAX

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter
    from .rmsnorm import cast_rne
except ImportError:  # the reference path still works without Triton
    triton = tl = None


def _fp8_weights(w, scale, DEQUANT_TILE: tl.constexpr, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """An e4m3 weight tile for the products. Row tiles of prompt chunks (DEQUANT_TILE) dequantize it
    in the activations' dtype, as the 16-bit weights would be (bf16(w * scale)), so the products
    chain in one accumulator; a compute-bound tile converts each weight once for many rows. Decode
    tiles keep it unscaled in fp16 (scaled after the product, per column: fewer operations a weight)."""
    # one return, every branch static: the compiler unifies the types of all returns it meets
    if DEQUANT_TILE:
        v = w.to(tl.float32) * scale[None, :]
        # the interpreter truncates fp32 -> bf16; the GPU's cast rounds to nearest even, as cast_rne does
        if INTERPRETED:
            out = cast_rne(v, dtype)
        else:
            out = v.to(dtype)
    elif dtype == tl.float32:
        out = w.to(tl.float32)
    else:
        out = w.to(tl.float16)  # exact: e4m3 values fit fp16
    return out


def _fp8_operand(a):
    """16-bit activations beside FP8 weights go into the products as fp16: e4m3 converts to fp16
    in one instruction per pair (to bf16 it takes several, which cost more than the bytes saved),
    and bf16 values convert exactly in fp16's normal range; the rare ones past it are clamped."""
    if a.dtype == tl.bfloat16:
        a = tl.clamp(a.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return a


def _round_e4m3(v):
    """fp32 values within +-448 rounded to e4m3's grid, nearest even, for the interpreter, whose
    fp32 -> float8 cast rounds otherwise (the GPU's cvt.rn is nearest even, as torch's cast)."""
    u = v.to(tl.uint32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # fp32's step at 1.5 * 2^14 is 2^-9, e4m3's below 2^-6
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


def _fp8_act(a, INTERPRETED: tl.constexpr):
    """A [rows, group] activation tile as e4m3 and each row's scale: fp8_blocks.quantize_act_groups
    in registers."""
    v = a.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), _ACT_FLOOR)
    top = tl.full(amax.shape, _E4M3_MAX, tl.float32)
    q = tl.clamp(v * tl.div_rn(top, amax)[:, None], -_E4M3_MAX, _E4M3_MAX)
    if INTERPRETED:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv), tl.div_rn(amax, top)


if triton is not None:  # called from the kernels, so built with them
    _E4M3_MAX = tl.constexpr(FP8_MAX)
    _ACT_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)
    _round_e4m3 = triton.jit(_round_e4m3)
    _fp8_act = triton.jit(_fp8_act)
    _fp8_operand = triton.jit(_fp8_operand)
    _fp8_weights = triton.jit(_fp8_weights)


def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, GROUP: tl.constexpr, INTERPRETED: tl.constexpr,
                          PDL: tl.constexpr = 0):
    """quantize_act_groups over [T, K]: one program a (row, group)."""
    pdl_enter(PDL)
    row, group = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    ok = cols < K
    v = tl.load(x_ptr + row * stride_x + cols[None, :], mask=ok[None, :], other=0.0)
    q, scale = _fp8_act(v, INTERPRETED)
    tl.store(q_ptr + row * K + cols[None, :], q, mask=ok[None, :])
    tl.store(s_ptr + row * tl.num_programs(1) + group + tl.arange(0, 1), scale)
