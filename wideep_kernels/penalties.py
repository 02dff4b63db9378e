"""Presence, frequency and repetition penalties applied to logits in one launch.

A penalized row reads its sequence's output counts (a row of engine/penalties.py's TokenCounts)
and whether each token is in its prompt. The torch reference gathers those rows, then takes a
dozen passes over [rows, vocab] temporaries (64 rows of 129K tokens: 33 MB each, about half a
millisecond on an H100 in bench/sampling.py's penalties row); the kernel reads each logit, count
and prompt flag once and writes each logit once.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # the reference path must keep working where triton is absent
    triton = None

BLOCK = 2048  # tokens a program covers


def apply_penalties_reference(logits: torch.Tensor, rows: torch.Tensor, count_rows: torch.Tensor,
                              counts: torch.Tensor, in_prompt: torch.Tensor, params: torch.Tensor) -> None:
    """In place, for each i: logits[rows[i]] penalized by params[i] = (repetition, frequency,
    presence), with c = counts[count_rows[i]]. A token seen (c > 0, or in_prompt) has its logit
    divided by the repetition penalty if positive, multiplied if not (the CTRL paper's rule, as
    transformers and vLLM apply it); then frequency × c and presence × (c > 0) are subtracted
    (OpenAI's formula)."""
    c = counts.index_select(0, count_rows)
    seen = (c > 0) | in_prompt.index_select(0, count_rows)
    rep, freq, pres = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    sub = logits.index_select(0, rows)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    logits[rows] = sub - freq * c - pres * (c > 0).float()


if triton is not None:

    @triton.jit
    def _penalties_kernel(logits_ptr, counts_ptr, prompt_ptr, rows_ptr, count_rows_ptr, params_ptr, vocab,
                          stride_l, stride_c, stride_p, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        row = tl.load(rows_ptr + i).to(tl.int64)
        crow = tl.load(count_rows_ptr + i).to(tl.int64)
        rep = tl.load(params_ptr + i * 3)
        freq = tl.load(params_ptr + i * 3 + 1)
        pres = tl.load(params_ptr + i * 3 + 2)
        c = tl.load(counts_ptr + crow * stride_c + tokens, mask=inside, other=0.0)
        in_prompt = tl.load(prompt_ptr + crow * stride_p + tokens, mask=inside, other=0)
        x = tl.load(logits_ptr + row * stride_l + tokens, mask=inside, other=0.0)
        seen = (c > 0) | (in_prompt != 0)
        # div_rn: torch's division rounds to nearest, Triton's `/` may be approximate
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        x = x - freq * c - pres * (c > 0).to(tl.float32)
        tl.store(logits_ptr + row * stride_l + tokens, x, mask=inside)


def apply_penalties_triton(logits: torch.Tensor, rows: torch.Tensor, count_rows: torch.Tensor,
                           counts: torch.Tensor, in_prompt: torch.Tensor, params: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("triton is not available")
    _check(logits, rows, count_rows, counts, in_prompt, params)
    if rows.numel() == 0:
        return
    vocab = logits.shape[1]
    _penalties_kernel[(rows.numel(), triton.cdiv(vocab, BLOCK))](
        logits, counts, in_prompt.view(torch.uint8), rows, count_rows, params, vocab,
        logits.stride(0), counts.stride(0), in_prompt.stride(0), BLOCK=BLOCK, num_warps=4,
        enable_fp_fusion=False)  # the reference's roundings: a fused multiply-add would move last bits


def _check(logits, rows, count_rows, counts, in_prompt, params) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] float32 with contiguous rows, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    vocab, n = logits.shape[1], rows.shape[0] if rows.dim() == 1 else -1
    if counts.dtype != torch.float32 or counts.dim() != 2 or counts.shape[1] != vocab or counts.stride(1) != 1:
        raise ValueError(f"counts must be [n, {vocab}] float32, got {tuple(counts.shape)} {counts.dtype}")
    if in_prompt.dtype != torch.bool or in_prompt.shape != counts.shape or in_prompt.stride(1) != 1:
        raise ValueError(f"in_prompt must be bool shaped as counts {tuple(counts.shape)}, got "
                         f"{tuple(in_prompt.shape)} {in_prompt.dtype}")
    for name, t in (("rows", rows), ("count_rows", count_rows)):
        if t.dtype not in (torch.int32, torch.int64) or t.shape != (n,):
            raise ValueError(f"{name} must be [{n}] integers, got {tuple(t.shape)} {t.dtype}")
    if params.dtype != torch.float32 or params.shape != (n, 3) or not params.is_contiguous():
        raise ValueError(f"params must be [{n}, 3] float32 (repetition, frequency, presence), got "
                         f"{tuple(params.shape)} {params.dtype}")


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, count_rows: torch.Tensor,
                    counts: torch.Tensor, in_prompt: torch.Tensor, params: torch.Tensor) -> None:
    """In place: logits [R, vocab] float32; rows [n] (distinct) and count_rows [n] index logits
    and counts / in_prompt [C, vocab] (float32 / bool); params [n, 3] float32. See the reference."""
    _check(logits, rows, count_rows, counts, in_prompt, params)
    if triton_ok(logits):
        kernel_or_reference("penalties", apply_penalties_triton, apply_penalties_reference,
                            logits, rows, count_rows, counts, in_prompt, params)
    else:
        apply_penalties_reference(logits, rows, count_rows, counts, in_prompt, params)
