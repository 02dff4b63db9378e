"""Sparse MQA indexer for decode: score every cached position of each sequence, keep the top-k.

Decode form of engine/attention.py `index_topk_mask` (one query per sequence), reading the
index keys of one KV-source layer through the paged block table:

    score(b, j) = sum_h w[b, h] * relu(q[b, h] . key(b, j))                  (fp32)
    key(b, j)   = index_keys[block_tables[b, j // bs] * bs + j % bs],  0 <= j < g_lens[b]

The top-k positions by score are kept; equal scores prefer the later position (relu makes
exact-zero ties common, and the prefill path breaks them that way too).
"""
from __future__ import annotations

import os

import torch

from . import triton_ok
from .index_score import _next_pow2, _score_choice, _score_launch, indexer_scores_triton  # noqa: F401 (the API)
from .radix_select import _SELECT_BLOCK, radix_passes
from .row_select import MANY_ROWS, SPARSE_MAX_ROWS, WORKSPACE_COLS, select_rows
from .score_warmup import build_wide_variants, remember as remember_scoring

try:
    import triton
    from .pdl import pdl_launch
    from .radix_select import (_chunk_offsets_kernel, _count_chunk_kernel, _emit_chunk_kernel, _emit_rows_kernel,
                               _radix_kth_kernel)
except Exception:  # a CPU-only install without triton still gets the reference
    triton = None


def indexer_scores_reference(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                             block_tables: torch.Tensor, g_lens: torch.Tensor,
                             block_size: int, key_scale: torch.Tensor | None = None,
                             w_scale: float = 1.0) -> torch.Tensor:
    """fp32 scores [B, M*block_size]; -inf at positions j >= g_lens[b]. With key_scale [S]
    (FP8 index keys), key = index_keys[slot] * key_scale[slot]. The head weights are
    w.float() * w_scale (the model's 1/sqrt(heads), applied in the kernel instead of by two
    more launches)."""
    num_seqs, max_blocks = block_tables.shape
    width = max_blocks * block_size
    pos = torch.arange(width, device=q.device)
    live = pos[None, :] < g_lens.to(q.device).long()[:, None]
    blocks = block_tables.long()[:, pos // block_size]
    # Table entries past a sequence's last block may hold anything: never follow them.
    slots = torch.where(live, blocks * block_size + pos % block_size, 0)
    keys = index_keys[slots].float()
    if key_scale is not None:
        keys = keys * key_scale[slots].float()[..., None]
    s = torch.einsum("bhd,bld->bhl", q.float(), keys).relu()
    s = (s * (w.float() * w_scale)[:, :, None]).sum(1)
    return s.masked_fill(~live, float("-inf"))


def _pad_positions(pos: torch.Tensor, topk: int) -> torch.Tensor:
    if pos.shape[1] < topk:
        pad = pos.new_full((pos.shape[0], topk - pos.shape[1]), -1)
        pos = torch.cat([pos, pad], dim=1)
    return pos


def select_topk_reference(scores: torch.Tensor, g_lens: torch.Tensor, topk: int) -> torch.Tensor:
    """Positions [B, topk] int32 of each row's top-k scores, best first, equal scores latest
    position first; -1 past min(g_len, topk). Positions >= g_len are never chosen."""
    width = scores.shape[1]
    k = min(topk, width)
    # Stable sort of the reversed row: among equal scores the later position comes first.
    order = scores.flip(-1).sort(dim=-1, descending=True, stable=True).indices[:, :k]
    pos = width - 1 - order
    pos = torch.where(pos < g_lens.to(pos.device).long()[:, None], pos, -1).to(torch.int32)
    return _pad_positions(pos, topk)


def indexer_topk_reference(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                           block_tables: torch.Tensor, g_lens: torch.Tensor,
                           block_size: int, topk: int, key_scale: torch.Tensor | None = None,
                           w_scale: float = 1.0) -> torch.Tensor:
    """Positions [B, topk] int32 of the top-k scores, best first; -1 fills rows with fewer."""
    scores = indexer_scores_reference(q, w, index_keys, block_tables, g_lens, block_size, key_scale, w_scale)
    return select_topk_reference(scores, g_lens, topk)


# Rows up to FUSED_MAX_WIDTH get the whole selection in one launch (wideep_kernels/row_select.py), in
# batches of at least FUSED_MIN_ROWS rows and under FUSED_MAX_POSITIONS positions (below). Other
# rows get the k-th score from the multi-launch radix passes, or, once the batch holds
# THRESHOLD_MIN_POSITIONS positions or more, from the candidates above a bound
# (wideep_kernels/wide_select.py); one launch then writes the positions (wideep_kernels/radix_select.py).
# On the H200 the one launch took 1-2% off the decode step at 8K against the radix passes, and
# lost at 128K-512K, where MAX_PARTS programs a row are too few (RESULTS, ninth session). The
# selection alone (bench.probe_select --wide, us; RESULTS, fourteenth session): radix passes /
# threshold / torch.topk at batch 1 and 512K 28 / 35 / 94, batch 16 and 64K 39 / 45 / 79, batch 16
# and 128K 65 / 55 / 96, batch 16 and 512K 221 / 120 / 198, batch 64 and 64K 116 / 97 / 130. The
# batch-16 decode step at 512K went from 11.54 (torch.topk) to 9.64 ms. One program a row walking
# the whole row was slower than all of them (28-64 us at 8K). Prompt chunks' rows past 32K keep
# the threshold select too: 1,024 rows of 128K took 1,318 us against 1,719 for the one launch at
# its best split, and a 100K prompt's prefill 3,300 ms against 3,406 (RESULTS, forty-third session).
# WIDEEP_ONE_LAUNCH_SELECT=0 turns the one launch off (its programs wait on each other at
# barriers, which needs a row's programs resident together; every GPU we know holds them).
FUSED_MAX_WIDTH = 32768 if os.environ.get("WIDEEP_ONE_LAUNCH_SELECT", "1") != "0" else 0
THRESHOLD_MIN_POSITIONS = 1 << 21
# Rows up to FUSED_MAX_WIDTH still go to the threshold select where they hold FUSED_MAX_POSITIONS
# positions or more in all: a prompt chunk's 1,024 rows from 24K on (1,024 rows on an H100, us:
# one launch / threshold at 16K 271 / 322, 24K 386 / 366, 32K 501 / 388; RESULTS, forty-fifth
# session). No decode batch is that large. WIDEEP_FUSED_MAX_POSITIONS sets it.
FUSED_MAX_POSITIONS = int(os.environ.get("WIDEEP_FUSED_MAX_POSITIONS", str(1024 * 24576)))
# Batches of fewer rows than FUSED_MIN_ROWS take the radix passes instead: on an H100 the decode
# step at 8K (bench.forward --select, one launch -> radix passes) took 1.441 -> 1.404 ms at batch
# 1, 2.405 -> 2.284 at 4, 2.807 -> 2.735 at 8, and the same at 16 and 64 (RESULTS, forty-fifth
# session; the ninth session's H200 figures, before the radix passes' atomics and dependent
# launches, had the one launch ahead). WIDEEP_FUSED_MIN_ROWS sets it.
FUSED_MIN_ROWS = int(os.environ.get("WIDEEP_FUSED_MIN_ROWS", "16"))
# The threshold select's group maxima taken by the scoring launch (one read of the scores and a
# launch fewer a layer; wideep_kernels/index_score.py); WIDEEP_SCORE_MAXIMA=0 leaves them to their own
# kernel. The launch has T / tile programs a row for T groups: at least MAXIMA_MIN_PROGRAMS in all.
SCORE_MAXIMA = os.environ.get("WIDEEP_SCORE_MAXIMA", "1") != "0"
MAXIMA_MIN_PROGRAMS = 1024
# After the radix or threshold passes, the positions come from one launch (_emit_rows_kernel)
# rather than three (count, offsets, emit); WIDEEP_ONE_EMIT=0 keeps the three. The one launch
# writes a row's positions in the order its programs reach them.
ONE_EMIT = os.environ.get("WIDEEP_ONE_EMIT", "1") != "0"
# Chunk counts the offsets pass sums per step: a 1M-position row in one. (When each emit program
# summed them itself, 64 a step cost 74 us a layer at 512K on the H200 and 1024 a step 45 us.)
_EMIT_SUMS = 1024
# Programs in all, about, of the count and emit passes after the threshold select (above).
FITTED_PROGRAMS = 1024


def kth_scores(scores: torch.Tensor, k: int, method: str | None = None, span: int | None = None,
               block: int | None = None, num_warps: int = 8) -> torch.Tensor:
    """[B] fp32: each row's k-th largest score (1 <= k <= width), by `method` 'radix' (four 8-bit
    histogram passes over the scores' bits, no sort), 'threshold' (the same passes over the few
    thousand scores above a bound from group maxima: wideep_kernels/wide_select.py) or 'topk'
    (torch.topk); None picks by the rows' size (THRESHOLD_MIN_POSITIONS). span (positions a
    radix program counts), block (its loop step) and num_warps override the built-in launch
    choice (bench.probe_radix times them)."""
    num_seqs, width = scores.shape
    method = method or ("threshold" if num_seqs * width >= THRESHOLD_MIN_POSITIONS else "radix")
    if method == "topk":
        return torch.topk(scores, k, dim=1, sorted=False).values.amin(dim=1)
    kth = torch.empty(num_seqs, device=scores.device, dtype=torch.float32)
    if num_seqs == 0:
        return kth
    if method == "threshold":
        from .wide_select import threshold_passes  # not at the top: it builds on this module
        hist, state, _ = threshold_passes(scores, k)
    else:
        hist, state = radix_passes(scores, k, span, block, num_warps)
    _radix_kth_kernel[(num_seqs,)](hist, state, kth, num_seqs, k, num_warps=1, **pdl_launch(hist))
    return kth


def default_select(width: int, rows: int = 1) -> str:
    """The selection method `rows` rows of `width` positions get when none is asked for."""
    if width <= FUSED_MAX_WIDTH and FUSED_MIN_ROWS <= rows and rows * width < FUSED_MAX_POSITIONS:
        return "fused"
    return "threshold" if rows * width >= THRESHOLD_MIN_POSITIONS else "radix"


def select_topk_triton(scores: torch.Tensor, g_lens: torch.Tensor, topk: int,
                       chunk: int | None = None, method: str | None = None,
                       hist: torch.Tensor | None = None, maxima: torch.Tensor | None = None,
                       slots: torch.Tensor | None = None) -> torch.Tensor:
    """Positions [B, topk] int32 of the top-k scores of each row (the reference's tie rule),
    -1 past min(g_len, topk); in no particular order.

    `method` 'fused' does all of it in one launch (wideep_kernels/row_select.py); None picks by width
    (default_select). Otherwise the k-th largest score of each row comes from kth_scores (`method` 'radix',
    'threshold' or 'topk'), and two passes over chunks of the row keep every position scoring above it and fill
    the remaining places with the latest positions scoring exactly it. Dead positions (past
    g_len) score -inf ('threshold' ignores what they hold). `hist`: the selection's workspace, already
    zeroed (radix_passes' histograms, the one launch's [B, WORKSPACE_COLS], or with `maxima` the
    threshold select's); 'threshold' zeroes its own otherwise. `maxima`: the rows' group maxima
    for 'threshold', written by the scoring launch (wideep_kernels/wide_select.py threshold_passes).
    `slots`: [B, 2] int32 zeros for the one-launch emit's counters (ONE_EMIT; zeroed here if
    not given).
    """
    num_seqs, width = scores.shape
    out = torch.empty(num_seqs, topk, device=scores.device, dtype=torch.int32)
    k = min(topk, width)
    if num_seqs == 0 or k == 0:
        return out.fill_(-1)
    g_lens = g_lens.to(device=scores.device, dtype=torch.int32).contiguous()
    fill = min(1024, _next_pow2(topk, 16))
    method = method or default_select(width, num_seqs)
    if method == "fused":
        return select_rows(scores, g_lens, out, k, ws=hist)
    if method not in ("radix", "threshold", "topk"):
        raise ValueError(f"unknown selection method {method!r}; known: fused, radix, threshold, topk")
    found, capacity = g_lens, 0  # with the threshold select: the rows' candidate counts and places
    if method in ("radix", "threshold"):  # the count pass derives the k-th score from the last histogram
        if method == "radix":
            hist, state = radix_passes(scores, k, hist=hist)
        else:
            # Rows whose candidates fit take their positions from them; the passes below only
            # serve rows that overflowed.
            from .wide_select import candidate_buffers, emit_candidates, threshold_passes
            candidates = candidate_buffers(num_seqs, scores.device)
            capacity = candidates[0].shape[1]
            hist, state, found = threshold_passes(scores, k, g_lens, maxima=maxima, candidates=candidates,
                                                  ws=hist if maxima is not None else None)
            emit_candidates(candidates, found, hist, state, out, k, width)
        if ONE_EMIT:
            if slots is None:
                slots = torch.zeros(num_seqs, 2, device=scores.device, dtype=torch.int32)
            chunk = chunk or _SELECT_BLOCK
            num_chunks = triton.cdiv(width, chunk)
            fitted = method == "threshold"
            # (where the threshold select's candidates fit, as nearly always, programs only start
            # and leave: fewer of them, as for the passes below)
            grid = (num_seqs, min(num_chunks, max(1, FITTED_PROGRAMS // num_seqs)) if fitted else num_chunks)
            _emit_rows_kernel[grid](scores, g_lens, hist, state, slots, out, found, capacity, scores.stride(0),
                                    out.stride(0), width, num_seqs, k, topk, CHUNK=chunk, FILL=fill, FITTED=fitted,
                                    num_warps=4, **pdl_launch(scores))
            return out
        kth = torch.empty(num_seqs, device=scores.device, dtype=torch.float32)
    else:
        kth = kth_scores(scores, k, method)
        hist = state = kth  # not read
    chunk = chunk or _SELECT_BLOCK
    num_chunks = triton.cdiv(width, chunk)
    # one column more than the counts need: the offsets pass's outputs share their row stride
    above = torch.empty(num_seqs, num_chunks + 1, device=scores.device, dtype=torch.int32)
    equal = torch.empty_like(above)
    fitted = method == "threshold"
    # Where the threshold select's candidates fit (nearly always) these passes only read the
    # row's count and leave, and what they cost is their programs' start: at batch 16 and 512K,
    # 8192 such programs took 6 us a launch on the H200. So those rows get fewer programs, each
    # taking several chunks where the row did overflow.
    grid = (num_seqs, min(num_chunks, max(1, FITTED_PROGRAMS // num_seqs)) if fitted else num_chunks)
    _count_chunk_kernel[grid](scores, kth, g_lens, above, equal, hist, state, found, capacity, scores.stride(0),
                              above.stride(0), width, num_seqs, k, CHUNK=chunk, RADIX=method != "topk",
                              FITTED=fitted, num_warps=4, **pdl_launch(scores))
    before = torch.empty(num_seqs, num_chunks + 1, device=scores.device, dtype=torch.int32)
    after = torch.empty_like(before)
    _chunk_offsets_kernel[(num_seqs,)](above, equal, before, after, found, capacity, above.stride(0), num_chunks,
                                       SUMS=_EMIT_SUMS, FITTED=fitted, num_warps=4, **pdl_launch(above))
    _emit_chunk_kernel[grid](scores, kth, g_lens, before, after, out, found, capacity,
                             scores.stride(0), before.stride(0), out.stride(0), width, num_chunks, k, topk,
                             CHUNK=chunk, FILL=fill, FITTED=fitted, num_warps=4, **pdl_launch(scores))
    return out


def indexer_topk_triton(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                        block_tables: torch.Tensor, g_lens: torch.Tensor,
                        block_size: int, topk: int, key_scale: torch.Tensor | None = None,
                        w_scale: float = 1.0, row_groups=None) -> torch.Tensor:
    """Same position set as indexer_topk_reference, in no particular order. row_groups: as
    indexer_topk's."""
    num_seqs, width = q.shape[0], block_tables.shape[1] * block_size
    if q.is_cuda:
        remember_scoring(q, w, index_keys, key_scale, block_size, w_scale, topk)
    # The selection's workspace (the radix histograms, or the one launch's), zeroed by the scoring
    method = default_select(width, num_seqs) if 0 < min(topk, width) else None
    ws = maxima = slots = None
    if method == "radix":
        # the radix histograms and the one-launch emit's counters, zeroed together
        zeroed = torch.empty(4 * num_seqs * 256 + 2 * num_seqs, device=q.device, dtype=torch.int32)
        ws, slots = zeroed[:4 * num_seqs * 256].view(4, num_seqs, 256), zeroed[4 * num_seqs * 256:].view(num_seqs, 2)
    elif method == "fused":
        ws = torch.empty(num_seqs, WORKSPACE_COLS, device=q.device, dtype=torch.int32)
    elif method == "threshold" and SCORE_MAXIMA:
        # The scoring launch also takes the group maxima (the threshold select's first read of the
        # scores) and zeroes its workspace.
        from .wide_select import group_stride, threshold_workspace
        tile = _score_choice(q, key_scale is not None)["tile"]
        ws = threshold_workspace(num_seqs, q.device)
        # More groups than the bound needs where the batch is small: the launch has as many
        # programs a row as the stride has tiles.
        stride = max(group_stride(width, min(topk, width)), triton.cdiv(MAXIMA_MIN_PROGRAMS, num_seqs) * tile)
        maxima = torch.empty(num_seqs, triton.cdiv(stride, tile) * tile, device=q.device, dtype=torch.float32)
    scores = _score_launch(q, w, index_keys, block_tables, g_lens, block_size, key_scale=key_scale, w_scale=w_scale,
                           zero=zeroed if slots is not None else ws, skip_dead=method == "fused", maxima=maxima,
                           row_groups=row_groups)
    return select_topk_triton(scores, g_lens, topk, method=method, hist=ws, maxima=maxima, slots=slots)


def warm_up(topk: int, device, max_rows: int) -> None:
    """Build, on dummy scores, every selection variant serving can meet: the one-launch select
    with its atomics from the third byte pass and, from MANY_ROWS rows, the second; the radix
    passes with and without theirs (up to and past SPARSE_MAX_ROWS rows); and the wide rows' radix,
    threshold and torch.topk paths, whose widths the warm-up's requests never reach. Their builds
    depend on none of the widths (wideep_kernels/row_select.py, wideep_kernels/wide_select.py),
    so narrow rows build them. On a GPU, also the scoring launch's wide-row variants for the
    input layouts the warm-up's requests scored with (wideep_kernels/score_warmup.py)."""
    probe = torch.empty(0, device=device)
    if triton is None or not triton_ok(probe) or topk <= 0:
        return
    width = 64 * (topk // 64 + 1)  # past topk: a real selection
    many = {MANY_ROWS} if max_rows >= MANY_ROWS else set()  # the one launch's prompt-chunk variant
    for rows in sorted({1, min(max_rows, SPARSE_MAX_ROWS + 1)} | many):
        scores = torch.zeros(rows, width, device=device)
        g_lens = torch.full((rows,), width, dtype=torch.int32, device=device)
        for method in ("fused", "radix", "threshold", "topk"):
            select_topk_triton(scores, g_lens, topk, method=method)
    if probe.is_cuda:
        build_wide_variants(device)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                 block_tables: torch.Tensor, g_lens: torch.Tensor,
                 block_size: int, topk: int, key_scale: torch.Tensor | None = None,
                 w_scale: float = 1.0, row_groups=None) -> torch.Tensor:
    """Top-k cached positions per decoding sequence by indexer score.

    q [B, Hi, Di], w [B, Hi], index_keys [S, Di] (slot = block * block_size + offset),
    block_tables [B, M] int32, g_lens [B] int32 (sequence b sees positions 0..g_lens[b]-1).
    Returns [B, topk] int32 positions (not slots); -1 fills the row past min(g_len, topk).
    Row order is unspecified (best-first on the reference path). FP8 index keys
    (float8_e4m3fn) come with key_scale [S] fp32: key = index_keys[slot] * key_scale[slot].
    The head weights are w.float() * w_scale. row_groups: where the rows are prompt tokens,
    their groups of one sequence (wideep_kernels/index_score_rows.py prompt_row_groups), which
    lets the scoring read a sequence's keys once for a group's rows.
    """
    if triton is not None and triton_ok(q):
        return indexer_topk_triton(q, w, index_keys, block_tables, g_lens, block_size, topk, key_scale, w_scale,
                                   row_groups)
    return indexer_topk_reference(q, w, index_keys, block_tables, g_lens, block_size, topk, key_scale, w_scale)
