"""Structured output's token mask applied to logits in one launch.

A grammar's mask (engine/structured.py) is one bit per vocabulary token, packed into int32
words: bit t % 32 of word t // 32 set means token t may come next. The rows of a batch that
have a grammar get every token whose bit is clear set to -inf. Unpacking the bits in torch (the
reference) is several launches and [rows, vocab] temporaries a step (8 MB of bytes and as many
of flags for 64 rows of 129K tokens); the kernel reads the mask words and writes only the
logits it masks.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # the reference path must keep working where triton is absent
    triton = None

BLOCK = 1024  # tokens a program covers: 32 mask words


def unpack_mask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool, True where the token is allowed. Read as bytes
    (little-endian, as CPUs and GPUs store words: bit t is bit t % 8 of byte t // 8), so the
    temporary is a byte a token, not four."""
    as_bytes = mask.contiguous().view(torch.uint8)
    bits = (as_bytes[:, :, None] >> torch.arange(8, dtype=torch.uint8, device=mask.device)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].bool()


def apply_token_mask_reference(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf wherever bit t of mask[i] is clear."""
    allowed = unpack_mask(mask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


if triton is not None:

    @triton.jit
    def _apply_token_mask_kernel(logits_ptr, mask_ptr, rows_ptr, vocab, stride_l, stride_m, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        words = tl.load(mask_ptr + i * stride_m + tokens // 32, mask=inside, other=-1)
        allowed = ((words >> (tokens % 32)) & 1) != 0
        row = tl.load(rows_ptr + i)
        dst = logits_ptr + row * stride_l + tokens
        tl.store(dst, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=inside & ~allowed)


def apply_token_mask_triton(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not available")
    _check(logits, mask, rows)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    _apply_token_mask_kernel[(rows.numel(), triton.cdiv(vocab, BLOCK))](
        logits, mask, rows, vocab, logits.stride(0), mask.stride(0), BLOCK=BLOCK, num_warps=4)


def _check(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows, got {tuple(logits.shape)}")
    if mask.dtype != torch.int32 or mask.dim() != 2 or mask.stride(1) != 1 or mask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"mask must be [n, >= vocab/32] int32, got {tuple(mask.shape)} {mask.dtype}")
    if rows.dtype not in (torch.int32, torch.int64) or rows.shape != (mask.shape[0],):
        raise ValueError(f"rows must be [{mask.shape[0]}] integers, got {tuple(rows.shape)} {rows.dtype}")


def apply_token_mask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits [R, vocab] (any float dtype), mask [n, words] int32 (on logits' device),
    rows [n]: the row of logits each mask row applies to (distinct). Each masked token's logit
    becomes -inf."""
    _check(logits, mask, rows)
    if triton_ok(logits):
        kernel_or_reference("token_mask", apply_token_mask_triton, apply_token_mask_reference, logits, mask, rows)
    else:
        apply_token_mask_reference(logits, mask, rows)
