"""DeepSeek's block FP8 weights: float8 e4m3 with one float32 scale per [rows, cols] block.

The scale is stored as `<name>.weight_scale_inv` but multiplies: w = fp8 * scale, each scale
covering one block, the last blocks of a row or column cropped to the weight's shape (the
reference `weight_dequant` of DeepSeek-V3's inference code).
"""
from __future__ import annotations

import math
import re

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
SCALE_SUFFIX = "_scale_inv"

# The Linear weights DeepSeek stores in FP8: attention projections and every MLP's gate / up /
# down (dense, shared and routed experts). Embeddings, lm_head, norms, the router and its bias
# stay in bf16, as do the indexer's weights here (they are small and score-sensitive).
FP8_LINEAR = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | list[int]) -> tuple[int, int]:
    """The scale grid of a 2-D weight: one entry per block, partial blocks included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) with each block's largest magnitude mapped to 448;
    an all-zero block gets scale 1 so that dequantizing never divides by zero."""
    rows, cols = w.shape
    bo, bi = block
    nbo, nbi = scale_shape(w.shape, block)
    padded = w.new_zeros(nbo * bo, nbi * bi, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nbo, bo, nbi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # amax / scale can round to just above 448, which float8 cannot hold
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(nbo * bo, nbi * bi)[:rows, :cols].contiguous(), scale


def dequantize_fp8_blocks(fp8: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int] | list[int]) -> torch.Tensor:
    """float32 weight = fp8 * its block's scale."""
    rows, cols = fp8.shape
    bo, bi = block
    per_element = scale.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return fp8.float() * per_element
