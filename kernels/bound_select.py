"""The top-k of wide rows from the candidates above a bound guessed from the previous step.

The threshold select (kernels/wide_select.py) proves its bound each step: strided group maxima,
a radix select over them, then a pass over the row's scores for the candidates above it. Its
launches and reads cost more than the scoring at batch 1 (24 us a layer at 512K on the H200,
against 14 for the scoring). Yet from one decode step to the next a sequence's k-th score moves
little: its index keys are the same but one, only the query is new. So each row keeps a bound
from its last step, and the scoring launch itself appends every score at or above it to the
row's candidates (kernels/index_score.py). The rest is the threshold select's: four histogram
passes over the candidates find the k-th score, and the candidates give the positions.

Bounds are kept relative to each step's score scale, sum over heads of max(w_h, 0) |q_h| (what
a unit key along each adding head's query would score), which the scoring launch takes from the
query it has loaded anyway: a query of another size moves the bound with the scores. With
queries drawn independently each step and random keys (simulated, 8 heads of 64, 128K keys) the
k-th score's spread across steps is 48% of its mean, and 16% relative to that scale; the 2 k-th
score lies 16% below the k-th, the 4 k-th 33%.

The bound is a guess and is checked, never trusted: a row whose candidates are fewer than
min(k, g_len) (the bound was above its k-th score) or more than the capacity takes the passes
over its whole row instead, exactly as an overflowing row of the threshold select does. A miss
costs time, never a position. After each step the row's next bound is its k-th score less a gap
that would have held about (1 + MARGIN) k candidates, were the scores near the k-th as dense as
this step's (kernels/wide_select.py _next_bound): it widens at most 4x a step; after too few
candidates it makes room for the k-th score falling as far again.

`bounds` [4, R] fp32 is the state a caller keeps across steps, a column a row (row b of a step
reads and writes column b): the bounds and their gaps (relative to the score scale; the bound
-inf at first: every score a candidate), each row's count of misses (which benchmarks read),
and the scale of the step.
"""
from __future__ import annotations

import torch

# Candidates the bound aims to keep beyond the k it needs, in units of k (the capacity is 8 k at
# k = 2048).
MARGIN = 3.0

try:
    from .pdl import pdl_launch
    from .wide_select import (BLOCK, CANDIDATE_PROGRAMS, _candidate_kernel, _cdiv, candidate_buffers,
                              candidate_passes, emit_candidates)
except Exception:  # a CPU-only install without triton: only bound_state is used (the engine keeps
    pass           # the state; the indexer's reference path ignores it)


def bound_state(rows: int, device) -> torch.Tensor:
    """Fresh bounds for `rows` rows: no guess yet (every score a candidate), no misses."""
    state = torch.zeros(4, rows, device=device, dtype=torch.float32)
    state[0] = float("-inf")
    state[3] = 1.0
    return state


def bound_misses(bounds: torch.Tensor) -> torch.Tensor:
    """Each row's count of steps whose bound missed."""
    return bounds[2]


def check_bounds(bounds: torch.Tensor, num_seqs: int) -> None:
    if bounds.dtype != torch.float32 or bounds.dim() != 2 or bounds.shape[0] != 4 or bounds.shape[1] < num_seqs:
        raise ValueError(f"bounds must be fp32 [4, R] with R >= {num_seqs} rows (bound_state), "
                         f"got {bounds.dtype} {tuple(bounds.shape)}")
    if not bounds.is_contiguous():
        raise ValueError("bounds must be contiguous")


def bound_workspace(num_seqs: int, device) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(hist [4, B, 256] int32 for the scoring launch to zero, count [B] int32 zeroed, the
    candidate buffers). The count is zeroed here, not by the scoring launch, whose programs
    add to it."""
    hist = torch.empty(4, num_seqs, 256, device=device, dtype=torch.int32)
    count = torch.zeros(num_seqs, device=device, dtype=torch.int32)
    return hist, count, candidate_buffers(num_seqs, device)


def bound_candidates(scores: torch.Tensor, g_lens: torch.Tensor, bounds: torch.Tensor, count: torch.Tensor,
                     candidates: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Append each row's live scores >= its bound to `candidates`, counted in `count` (zeroed):
    what the scoring launch does itself for the indexer, for scores from elsewhere, whose scale
    is taken as 1."""
    num_seqs, width = scores.shape
    bounds[3, :num_seqs] = 1.0
    cand, cand_pos = candidates
    parts = max(1, min(_cdiv(width, BLOCK), CANDIDATE_PROGRAMS // max(num_seqs, 1)))
    blocks = _cdiv(width, parts * BLOCK)
    _candidate_kernel[(num_seqs, _cdiv(width, blocks * BLOCK))](
        scores, g_lens, count, bounds, count, cand, cand_pos, scores.stride(0), width, bounds.shape[1], blocks, 1,
        cand.shape[1], HAS_LENS=True, BLOCK=BLOCK, POSITIONS=True, BOUND=True, num_warps=4, **pdl_launch(scores))


def bound_select(scores: torch.Tensor, g_lens: torch.Tensor, k: int, out: torch.Tensor, bounds: torch.Tensor,
                 workspace: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Fill out [B, topk] with the top-k positions of each row whose candidates hold them and set
    every row's next bound; returns (hist, radix state, count, capacity) for select_topk_triton's
    passes over the rows that missed. `workspace`: bound_workspace's, its candidates already taken by
    the scoring launch; without it they are taken here from `scores`."""
    num_seqs, width = scores.shape
    check_bounds(bounds, num_seqs)
    if workspace is None:
        workspace = bound_workspace(num_seqs, scores.device)
        workspace[0].zero_()
        bound_candidates(scores, g_lens, bounds, workspace[1], workspace[2])
    hist, count, candidates = workspace
    state = candidate_passes(scores, k, g_lens, count, hist, candidates[0])
    emit_candidates(candidates, count, hist, state, out, k, width, g_lens=g_lens, bounds=bounds, margin=MARGIN)
    return hist, state, count, candidates[0].shape[1]
