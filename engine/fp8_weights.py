"""DeepSeek's block FP8 weights: float8 e4m3 with one float32 scale per [rows, cols] block.

The scale is stored as `<name>.weight_scale_inv` but multiplies: w = fp8 * scale, each scale
covering one block, the last blocks of a row or column cropped to the weight's shape (the
reference `weight_dequant` of DeepSeek-V3's inference code).
"""
from __future__ import annotations

import re

SCALE_SUFFIX = "_scale_inv"

# The Linear weights DeepSeek stores in FP8: attention projections and every MLP's gate / up /
# down (dense, shared and routed experts). Embeddings, lm_head, norms, the router and its bias
# stay in bf16, as do the indexer's weights here (they are small and score-sensitive).
FP8_LINEAR = re.compile(
    r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$")
