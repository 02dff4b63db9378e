"""The fused MoE expert compute's exact semantics (wideep_kernels/moe_gemm.py's reference path) and the
argument checks the reference and the kernels share."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_blocks import ExpertScales, act_group, check_expert_scales, dequantize_experts, fake_quantize_act


def pairs_per_token(num_tokens: int, num_pairs: int) -> int:
    """k of token-major pairs (token_of None), checked."""
    if num_pairs == 0:
        return 1
    if num_tokens == 0 or num_pairs % num_tokens:
        raise ValueError(f"token_of=None needs k pairs per token: {num_pairs} pairs for {num_tokens} tokens")
    return num_pairs // num_tokens


def token_major(token_of: torch.Tensor | None, x: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """token_of itself, or p // k for token-major pairs."""
    if token_of is not None:
        return token_of
    k = pairs_per_token(x.shape[0], slot_of.numel())
    return torch.div(torch.arange(slot_of.numel(), device=slot_of.device), k, rounding_mode="floor")


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, token_of: torch.Tensor | None,
                            slot_of: torch.Tensor, weight_of: torch.Tensor,
                            shared: tuple | None = None, scales: ExpertScales | None = None,
                            act_fp8: bool = False, shared_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The exact semantics: one matmul pair per slot (and for the shared expert, weight 1, on the
    tokens of `shared_rows` (first, end) or all),
    weighted sum in fp32, output in x's dtype. FP8 weights: dequantized to fp32 and computed in
    fp32, the SwiGLU activation rounded to x's dtype between the projections (as the kernels store it).
    act_fp8: each projection's input through fake_quantize_act first."""
    token_of = token_major(token_of, x, slot_of)
    kept = slot_of >= 0  # a host sync: acceptable for the reference
    token_of, slot_of, weight_of = token_of[kept], slot_of[kept], weight_of[kept]
    num_slots = w13.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if shared is not None:
        shared = check_shared(shared, w13, w2, scales)
    check_expert_scales(w13, w2, scales)
    group = check_act_fp8(act_fp8, scales)
    if scales is not None:
        w13, w2 = dequantize_experts(w13, w2, scales)
        shared = None if shared is None else dequantize_experts(*shared)

    def mlp(rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        rows = fake_quantize_act(rows, group) if group else rows
        gate, up = F.linear(rows.to(w_gate_up.dtype), w_gate_up).chunk(2, dim=-1)
        act = F.silu(gate) * up
        if scales is not None:
            act = act.to(x.dtype).float()
        return F.linear(fake_quantize_act(act, group) if group else act, w_down)

    if shared is not None:
        first, end = check_shared_rows(shared_rows, x.shape[0])
        out[first:end] += mlp(x[first:end], shared[0], shared[1]).float()
    order = slot_of.argsort(stable=True)
    counts = torch.zeros(num_slots, dtype=torch.long, device=x.device).scatter_add_(
        0, slot_of, torch.ones_like(slot_of))
    start = 0
    for slot, n in enumerate(counts.tolist()):  # a host sync: acceptable for the reference
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = token_of[pairs]
        y = mlp(x[tokens], w13[slot], w2[slot])
        out.index_add_(0, tokens, y.float() * weight_of[pairs].float()[:, None])
    return out.to(x.dtype)


def check_act_fp8(act_fp8: bool, scales: ExpertScales | None) -> int:
    """The activation group of FP8 activations (0 without them); they need FP8 weights in blocks
    of at least 32 columns (an FP8 tensor-core product takes 32 k a step)."""
    if not act_fp8:
        return 0
    if scales is None:
        raise ValueError("FP8 activations (act_fp8) need block-FP8 expert weights (scales)")
    if scales.block[1] < 32:
        raise ValueError(f"FP8 activations (act_fp8) need weight blocks of at least 32 columns, got {scales.block}")
    return act_group(scales.block)


def check_shared_rows(shared_rows: tuple[int, int] | None, num_tokens: int) -> tuple[int, int]:
    """(first, end) of the tokens the shared expert takes: all of them when None."""
    if shared_rows is None:
        return 0, num_tokens
    first, end = (int(v) for v in shared_rows)
    if not 0 <= first <= end <= num_tokens:
        raise ValueError(f"shared_rows {tuple(shared_rows)} must lie within the {num_tokens} tokens")
    return first, end


def check_shared(shared: tuple, w13: torch.Tensor, w2: torch.Tensor,
                 scales: ExpertScales | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertScales | None]:
    """A shared expert (w13 [2I, H], w2 [H, I], and for FP8 routed experts its own ExpertScales)
    computed as one more slot: the routed experts' shapes, dtype and blocks, rows contiguous."""
    s13, s2, *rest = shared
    own = rest[0] if rest else None
    if s13.shape != w13.shape[1:] or s2.shape != w2.shape[1:] or s13.dtype != w13.dtype or s2.dtype != w2.dtype:
        raise ValueError(f"shared expert {list(s13.shape)}, {list(s2.shape)} {s13.dtype} does not match the "
                         f"routed experts' {list(w13.shape[1:])}, {list(w2.shape[1:])} {w13.dtype}")
    check_expert_scales(s13, s2, own)
    if own is not None and (scales is None or tuple(own.block) != tuple(scales.block)):
        raise ValueError("a shared expert's FP8 blocks must match the routed experts' blocks")
    return s13.contiguous(), s2.contiguous(), own
