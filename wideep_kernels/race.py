"""A token sampled from each row's softmax(logits / temperature) in one pass over the row.

The Gumbel-max form of the exponential race: argmax_t(l_t / T + g_t) with g_t = -log(-log(u_t)),
u_t uniform, samples token t with probability softmax(l / T)_t, so neither the softmax nor the
probabilities are ever written. The uniforms are Philox's (Triton's tl.rand) from a seed per
row and the token's index: a row's draw depends on its seed alone, not on the batch around it.
The torch path (engine/sampling.py) takes a dozen passes over [rows, vocab] temporaries for the
same draw (bench/sampling.py: 0.29 ms for 64 rows of 129K tokens on an H100).

Each program takes one chunk of one row and writes its best score and token; the chunks' best
is taken in torch (a [rows, chunks] argmax).
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # the reference path must keep working where triton is absent
    triton = None

BLOCK = 4096  # tokens a program covers
# The largest fp32 below 1: a uniform of 1 would make -log(-log(u)) infinite and its token certain.
# Philox's uniforms reach 1.0 once rounded to fp32 (about 2**-25 of them), so they are held below.
U_MAX = 1.0 - 2.0 ** -24

_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_U32 = 0xFFFFFFFF


def _mul_hi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b for a, b below 2**32, in int64 without overflow."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    mid = a_hi * b_lo + a_lo * b_hi  # below 2**33
    low = a_lo * b_lo + ((mid & 0xFFFF) << 16)  # below 2**49
    return (a_hi * b_hi + (mid >> 16) + (low >> 32)) & _U32, low & _U32


def philox_uniform_reference(seeds: torch.Tensor, count: int) -> torch.Tensor:
    """[len(seeds), count] float32: tl.rand(seeds[i], t) for t < count (Philox 4x32, 10 rounds:
    the first word of counter (t, 0, 0, 0) under key (seed's low, high 32 bits)), then held at
    most U_MAX."""
    seeds = seeds.to(torch.int64)[:, None]
    k0, k1 = seeds & _U32, (seeds >> 32) & _U32
    c0 = torch.arange(count, dtype=torch.int64, device=seeds.device)[None].expand(len(seeds), count)
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _U32, (k1 + _PHILOX_KEY_B) & _U32
    signed = torch.where(c0 >= 2 ** 31, c0 - 2 ** 32, c0)  # the word as an int32
    folded = torch.where(signed < 0, -signed - 1, signed).to(torch.int32)
    return (folded.float() * 4.6566127342e-10).clamp(max=U_MAX)


def race_scores_reference(logits: torch.Tensor, rows: torch.Tensor, inv_temperature: torch.Tensor,
                          seeds: torch.Tensor) -> torch.Tensor:
    """[n, vocab] fp32: each token's score l * inv_temperature - log(-log(u)), for row rows[i] of
    logits. A -inf logit (cut by a filter, a grammar or a bias) stays -inf."""
    x = logits.index_select(0, rows).float()
    scaled = torch.where(x == float("-inf"), x, x * inv_temperature[:, None])
    return scaled - torch.log(-torch.log(philox_uniform_reference(seeds, logits.shape[1])))


def race_sample_reference(logits: torch.Tensor, rows: torch.Tensor, inv_temperature: torch.Tensor,
                          seeds: torch.Tensor) -> torch.Tensor:
    """[n] int64: the token of highest race score of each row (the first of equal scores)."""
    return race_scores_reference(logits, rows, inv_temperature, seeds).argmax(-1)


if triton is not None:

    @triton.jit
    def _race_kernel(logits_ptr, rows_ptr, inv_t_ptr, seeds_ptr, best_ptr, token_ptr, vocab, stride_l, chunks,
                     U_MAX: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        c = tl.program_id(1)
        tokens = c * BLOCK + tl.arange(0, BLOCK)
        inside = tokens < vocab
        row = tl.load(rows_ptr + i).to(tl.int64)
        inv_t = tl.load(inv_t_ptr + i)
        seed = tl.load(seeds_ptr + i)
        x = tl.load(logits_ptr + row * stride_l + tokens, mask=inside, other=float("-inf")).to(tl.float32)
        u = tl.minimum(tl.rand(seed, tokens), U_MAX)
        scaled = tl.where(x == float("-inf"), x, x * inv_t)
        score = tl.where(inside, scaled - tl.log(-tl.log(u)), float("-inf"))
        best = tl.max(score, 0)
        at = tl.argmax(score, 0)
        tl.store(best_ptr + i * chunks + c, best)
        tl.store(token_ptr + i * chunks + c, c * BLOCK + at)


def race_sample_triton(logits: torch.Tensor, rows: torch.Tensor, inv_temperature: torch.Tensor,
                       seeds: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not available")
    _check(logits, rows, inv_temperature, seeds)
    n, vocab = rows.numel(), logits.shape[1]
    chunks = triton.cdiv(vocab, BLOCK)
    best = torch.empty(n, chunks, device=logits.device)
    token = torch.empty(n, chunks, dtype=torch.int32, device=logits.device)
    if n:
        _race_kernel[(n, chunks)](logits, rows, inv_temperature, seeds, best, token, vocab, logits.stride(0), chunks,
                                  U_MAX=U_MAX, BLOCK=BLOCK, num_warps=8)
    return token.gather(1, best.argmax(1, keepdim=True))[:, 0].long()


def _check(logits, rows, inv_temperature, seeds) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be [rows, vocab] floats with contiguous rows, got {tuple(logits.shape)}")
    n = rows.shape[0] if rows.dim() == 1 else -1
    if rows.dtype not in (torch.int32, torch.int64) or rows.shape != (n,):
        raise ValueError(f"rows must be [n] integers, got {tuple(rows.shape)} {rows.dtype}")
    if inv_temperature.dtype != torch.float32 or inv_temperature.shape != (n,):
        raise ValueError(f"inv_temperature must be [{n}] float32, got {tuple(inv_temperature.shape)}")
    if seeds.dtype != torch.int64 or seeds.shape != (n,):
        raise ValueError(f"seeds must be [{n}] int64, got {tuple(seeds.shape)} {seeds.dtype}")


def race_sample(logits: torch.Tensor, rows: torch.Tensor, inv_temperature: torch.Tensor,
                seeds: torch.Tensor) -> torch.Tensor:
    """[n] int64: a token of each row rows[i] of logits [R, vocab], drawn from
    softmax(logits[rows[i]] * inv_temperature[i]) with the uniforms of seeds[i] (int64)."""
    _check(logits, rows, inv_temperature, seeds)
    if triton_ok(logits):
        return kernel_or_reference("race", race_sample_triton, race_sample_reference,
                                   logits, rows, inv_temperature, seeds)
    return race_sample_reference(logits, rows, inv_temperature, seeds)
