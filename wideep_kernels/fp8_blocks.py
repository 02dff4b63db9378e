"""Block FP8 weights: float8 e4m3 with one float32 scale per [rows, cols] block.

The scale multiplies: w = fp8 * scale, each scale covering one block, the last blocks of a row
or column cropped to the weight's shape (DeepSeek-V3's `weight_dequant`). Checkpoints store
this layout (engine/fp8_weights.py reads it); the FP8 expert kernels (wideep_kernels/moe_gemm.py)
compute from it, with 16-bit activations or with FP8 ones quantized per token per 128 columns
(quantize_act_groups).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# FP8 activations: a group of zeros (padding rows) keeps a finite scale, so 448 / amax is defined
ACT_AMAX_FLOOR = 1e-12


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | list[int]) -> tuple[int, int]:
    """The scale grid of a 2-D weight: one entry per block, partial blocks included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) with each block's largest magnitude mapped to 448;
    an all-zero block gets scale 1 so that dequantizing never divides by zero. Leading dims
    (stacked expert slots) are kept: [..., rows, cols] -> [..., rows, cols], [..., rb, cb]."""
    *lead, rows, cols = w.shape
    bo, bi = block
    nbo, nbi = scale_shape((rows, cols), block)
    padded = w.new_zeros(*lead, nbo * bo, nbi * bi, dtype=torch.float32)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.view(*lead, nbo, bo, nbi, bi)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # amax / scale can round to just above 448, which float8 cannot hold
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, nbo * bo, nbi * bi)[..., :rows, :cols].contiguous(), scale


def dequantize_fp8_blocks(fp8: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | list[int]) -> torch.Tensor:
    """float32 weight = fp8 * its block's scale (leading dims as quantize_fp8_blocks keeps them)."""
    rows, cols = fp8.shape[-2:]
    bo, bi = block
    per_element = scale.float().repeat_interleave(bo, -2)[..., :rows, :].repeat_interleave(bi, -1)[..., :cols]
    return fp8.float() * per_element


class ExpertScales(NamedTuple):
    """The scales of block-FP8 expert weights, w13 [..., 2I, H] and w2 [..., H, I] in float8 e4m3
    (leading dim: the slots; none for one shared expert), one scale per `block` = (rows, cols):
    - w13 [..., 2 * ceil(I / rows), ceil(H / cols)]: the gate's row blocks, then the up's (the
      two are quantized as the separate weights they are: no block straddles them);
    - w2 [..., ceil(H / rows), ceil(I / cols)]."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int]


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor,
                     block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, ExpertScales]:
    """(fp8 w13, fp8 w2, their ExpertScales)."""
    inter = w13.shape[-2] // 2
    gate, up = quantize_fp8_blocks(w13[..., :inter, :], block), quantize_fp8_blocks(w13[..., inter:, :], block)
    down = quantize_fp8_blocks(w2, block)
    return (torch.cat([gate[0], up[0]], dim=-2), down[0],
            ExpertScales(torch.cat([gate[1], up[1]], dim=-2), down[1], tuple(block)))


def dequantize_experts(w13: torch.Tensor, w2: torch.Tensor,
                       scales: ExpertScales) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (w13, w2) of quantize_experts' results."""
    inter, half = w13.shape[-2] // 2, scales.w13.shape[-2] // 2
    gate = dequantize_fp8_blocks(w13[..., :inter, :], scales.w13[..., :half, :], scales.block)
    up = dequantize_fp8_blocks(w13[..., inter:, :], scales.w13[..., half:, :], scales.block)
    return torch.cat([gate, up], dim=-2), dequantize_fp8_blocks(w2, scales.w2, scales.block)


def check_expert_scales(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales | None) -> None:
    """FP8 expert weights come with scales of their layout, and scales with FP8 weights."""
    fp8 = w13.dtype == torch.float8_e4m3fn
    if scales is None:
        if fp8 or w2.dtype == torch.float8_e4m3fn:
            raise ValueError("float8 expert weights need their scales (ExpertScales)")
        return
    if not fp8 or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expert scales go with float8_e4m3fn weights, not {w13.dtype} / {w2.dtype}")
    rows, cols = scales.block
    if rows <= 0 or cols < 16 or cols & (cols - 1):
        raise ValueError(f"FP8 expert blocks need rows > 0 and a power of two >= 16 for cols, got {scales.block}")
    inter, hidden = w13.shape[-2] // 2, w13.shape[-1]
    want13 = tuple(w13.shape[:-2]) + (2 * math.ceil(inter / rows), math.ceil(hidden / cols))
    want2 = tuple(w2.shape[:-2]) + scale_shape(w2.shape[-2:], scales.block)
    if tuple(scales.w13.shape) != want13 or tuple(scales.w2.shape) != want2:
        raise ValueError(f"expert scales {list(scales.w13.shape)}, {list(scales.w2.shape)} do not match weights "
                         f"{list(w13.shape)}, {list(w2.shape)} in blocks of {scales.block}: want {list(want13)}, "
                         f"{list(want2)}")


def act_group(block: tuple[int, int] | list[int]) -> int:
    """Columns per activation scale with FP8 activations: DeepSeek-V3's 128, or the weights' block
    cols where those are narrower (so one k step of the kernels covers one group of each)."""
    return min(128, block[1])


def quantize_act_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-`group`-column FP8 activations (DeepSeek-V3's inference scheme):
    (float8_e4m3fn [..., K], float32 scale [..., ceil(K / group)]), each group's largest magnitude
    mapped to 448. The FP8 expert kernels quantize their inputs this way (wideep_kernels/moe_gemm.py); this is
    their reference. An all-zero group quantizes to zeros."""
    *lead, k = x.shape
    groups = -(-k // group)
    padded = x.new_zeros(*lead, groups * group, dtype=torch.float32)
    padded[..., :k] = x.float()
    padded = padded.view(*lead, groups, group)
    amax = padded.abs().amax(-1).clamp(min=ACT_AMAX_FLOOR)
    # the kernels multiply by 448 / amax (correctly rounded) and clamp, as here
    q = (padded * (FP8_MAX / amax)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, groups * group)[..., :k], amax / FP8_MAX


def fake_quantize_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through quantize_act_groups and back, in float32: the values FP8 activations multiply."""
    q, scale = quantize_act_groups(x, group)
    return q.float() * scale.repeat_interleave(group, -1)[..., :x.shape[-1]]

