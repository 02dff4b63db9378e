"""The k-th largest score of wide rows (128K-1M positions) from a few thousand candidates, not a
sort of the row.

torch.topk over a 512K-position row cost the decode step 137 us a layer at batch 16 on the H200,
and the radix passes of wideep_kernels/radix_select.py (four histogram passes over the whole row) more; one
read of the row's scores costs about 8. Here the row is read twice and only a few thousand
scores are sorted into histograms:

1. Group maxima: m[b, j] = max over i of scores[b, j + i * T], for T = `group_stride` (at least
   GROUPS_PER_K k groups, 2 k by default). Groups are strided rather than runs of neighbouring
   positions: indexer scores follow position (recent positions score higher, neighbours alike),
   and then a run group's maximum says little about its other members. In a simulation of normal noise on a rising
   trend the candidates below were 2.2K for strided groups at 512K against 45K for runs
   (k = 2048, T = 8K; ~2.3K for both on i.i.d. normal scores). A row shorter than T (a short sequence in a wide batch)
   also has one live group per live position, so its bound is its exact k-th score.
2. tau[b] = the lowest score sharing the top two bytes of the k-th largest of m[b] (the first two
   radix_passes of wideep_kernels/radix_select.py on [B, T]). At least k groups have their maximum
   >= tau, so the row's k-th largest score is >= tau.
3. Candidates: every finite score >= tau is appended to cand[b] (`capacity` places) with a
   per-row atomic counter. The row's k highest scores are all there; order does not matter.
4. Four byte-histogram passes over the candidates find the k-th largest of them (from the third
   byte on, blocks with few matching keys count by atomics). A row whose
   candidates did not fit (many scores equal to tau: relu makes exact-zero ties) runs the same
   passes over its whole row instead. Each program reads the row's count and picks: no host
   sync, fixed shapes, so the whole of it is captured in a CUDA graph.

The last passes leave their histograms and state as radix_passes does, so _radix_kth_kernel
(kth_scores) and the count pass of select_topk_triton take the k-th score from them.

-inf scores (positions past g_len) are never candidates. Fewer than k finite ones means the
k-th score is -inf: the passes count the missing places up to k as -inf keys, which is the
k-th largest of the row with its -inf padding, as torch.topk gives it.
"""
from __future__ import annotations

import os

import torch

from .radix_select import _count_digits, _keep_radix_state, _radix_state, radix_passes

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
    from .row_select import _key_to_score, _order_key
except Exception:  # a CPU-only install without triton: the indexer never asks for this method
    triton = None
    tl = None

# Candidate places a row. i.i.d. normal scores give 1.1-1.5 k (2.3-2.8K at k = 2048, simulated), so
# a row overflows only when many scores tie at the bound; 64 KB a row.
CAPACITY = 16384
# Groups per k (T >= GROUPS_PER_K * k): more groups give a tighter bound and fewer candidates
# (i.i.d. normal, simulated: ~2.8K at 2 k, 2.3K at 4 k, 2.2K at 8 k), and longer passes over the
# maxima. Two beat four on an H100 (RESULTS, forty-fifth session): 1,024 rows of 64K 674 -> 529 us,
# of 128K 961 -> 851; batch 64 at 128K 90 -> 81 us; a 100K prompt's prefill 2,972 -> 2,837 ms.
# Three came between. WIDEEP_THRESHOLD_GROUPS sets it.
GROUPS_PER_K = int(os.environ.get("WIDEEP_THRESHOLD_GROUPS", "2"))
if GROUPS_PER_K < 1:
    raise ValueError(f"WIDEEP_THRESHOLD_GROUPS must be a positive integer, got {GROUPS_PER_K}")
# Group maxima: a program reads GROUP_ROWS members of GROUP_TILE neighbouring groups a step.
GROUP_TILE = 64
GROUP_ROWS = 32
# Positions a candidate or histogram program loads a step (one build for every width).
BLOCK = 1024
# Programs in all, about: the candidate launch reads the whole row and wants the memory busy;
# a histogram pass has work in a few programs a row unless the row overflowed, and the rest
# only leave, so it gets fewer.
CANDIDATE_PROGRAMS = 4096
PASS_PROGRAMS = 1024
# The candidates' launch: positions a program loads a step, its warps and software-pipeline stages
# (which do not apply to its loop with an atomic: one and four stages timed the same on an H100).
CANDIDATE_BLOCK = BLOCK
CANDIDATE_WARPS = 4
CANDIDATE_STAGES = 3
# The candidates' passes from the third byte on count blocks with few matching keys by atomics,
# as the one-launch select does (wideep_kernels/row_select.py): few of a row's candidates share
# the k-th's top two bytes. WIDEEP_THRESHOLD_SPARSE=0: histograms in every pass.
PASS_SPARSE_FROM = 2 if os.environ.get("WIDEEP_THRESHOLD_SPARSE", "1") != "0" else 4
PASS_SPARSE_MAX = 64
# Byte passes over the group maxima. The bound need not be their k-th largest exactly: the lowest
# score sharing its top two bytes is below it by at most 1/128 of it, which adds a few percent
# to the candidates (i.i.d. normal scores at 512K: about 180 over 2.3K), and spares two passes
# over [B, T] maxima, 0.1 ms at a prompt chunk's 1,024 rows.
MAXIMA_PASSES = 2

if triton is not None:

    # Integer arguments that change with the batch, k or the context are listed in
    # do_not_specialize (they only index scalars or bound loops); widths, strides and the
    # capacity keep their specialisation, as in wideep_kernels/indexer.py, so that the row loads
    # vectorise. T is always a multiple of GROUP_TILE, so its specialisation never changes.
    @triton.jit
    def _live_end(lens_ptr, seq, width, HAS_LENS: tl.constexpr):
        """The row's scores to use (below g_len) and those to load: up to a multiple of 16 past
        them (within the row), which keeps the loads vectorised; the few read between the two
        count as -inf (_load_live)."""
        end = width
        if HAS_LENS:
            end = tl.minimum(tl.load(lens_ptr + seq), width)
        return end, tl.minimum(tl.cdiv(end, 16) * 16, width)

    @triton.jit
    def _load_live(ptr, pos, end, load_end):
        s = tl.load(ptr + pos, mask=pos < load_end, other=float("-inf"))
        return tl.where(pos < end, s, float("-inf"))

    @triton.jit(do_not_specialize=["groups", "zero_count"])
    def _group_max_kernel(scores_ptr, lens_ptr, m_ptr, zero_ptr, stride_sb, width, stride, groups, zero_count,
                          HAS_LENS: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = 0):
        """m[seq, t] = the largest score at positions t + i * stride. Also zeroes the selection's
        histograms and counters (zero_count int32s), a share each program, which spares a launch."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        program = seq * tl.num_programs(1) + tl.program_id(1)
        share = tl.cdiv(zero_count, tl.num_programs(0) * tl.num_programs(1))
        for i in range(0, share, 256):
            idx = program * share + i + tl.arange(0, 256)
            tl.store(zero_ptr + idx, tl.zeros([256], dtype=tl.int32),
                     mask=(idx < (program + 1) * share) & (idx < zero_count))
        end, load_end = _live_end(lens_ptr, seq, width, HAS_LENS)
        t = tl.program_id(1) * TILE + tl.arange(0, TILE)
        row = scores_ptr + seq * stride_sb
        # The maximum is taken on the order keys: integers, so -0.0 and 0.0 stay apart exactly
        # as the radix passes order them.
        best = tl.zeros([TILE], dtype=tl.uint32)  # below every key: each group has member 0
        for i0 in range(0, groups, ROWS):
            pos = (i0 + tl.arange(0, ROWS))[:, None] * stride + t[None, :]
            best = tl.maximum(best, tl.max(_order_key(_load_live(row, pos, end, load_end)), axis=0))
        tl.store(m_ptr + seq * stride + t, _key_to_score(best))

    @triton.jit(do_not_specialize=["num_seqs", "blocks", "k"])
    def _candidate_kernel(scores_ptr, lens_ptr, hist_ptr, state_ptr, count_ptr, cand_ptr, cand_pos_ptr, stride_sb,
                          width, num_seqs, blocks, k, capacity,
                          HAS_LENS: tl.constexpr, BLOCK: tl.constexpr, POSITIONS: tl.constexpr = False,
                          BOUND_PASS: tl.constexpr = 3, PDL: tl.constexpr = 0):
        """Append the finite scores >= tau of `blocks` blocks of the row to cand[seq] (and,
        POSITIONS, their positions to cand_pos[seq]); count[seq] counts them all, also those past
        the capacity, which are dropped. tau: the lowest score sharing the top BOUND_PASS + 1
        bytes of the k-th largest group maximum (from the maxima's histogram of that byte), at or
        below that maximum and so below the row's k-th score."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        end, load_end = _live_end(lens_ptr, seq, width, HAS_LENS)
        start = tl.program_id(1) * blocks * BLOCK
        if start >= end:
            return
        prefix, _ = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, BOUND_PASS)
        # (keys below -inf's are NaNs: a maximum of -inf, fewer than k finite groups, stays -inf)
        tau = _key_to_score(tl.maximum(prefix.to(tl.uint32, bitcast=True) << (24 - 8 * BOUND_PASS), 0x007FFFFF))
        row = scores_ptr + seq * stride_sb
        for b in range(0, blocks):
            pos = start + b * BLOCK + tl.arange(0, BLOCK)
            s = _load_live(row, pos, end, load_end)
            keep = (s >= tau) & (s > float("-inf"))
            kept = tl.sum(keep.to(tl.int32), axis=0)
            # One atomic a block: most blocks of a wide row keep a few scores or none. (One atomic
            # a kept score where a block keeps at most 32, without the prefix sum, was slower on
            # the H200: the threshold select at batch 16 and 512K 74.5 against 70.1 us.)
            if kept > 0:
                place = tl.atomic_add(count_ptr + seq, kept, sem="relaxed") + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(cand_ptr + seq * capacity + place, s, mask=keep & (place < capacity))
                if POSITIONS:
                    tl.store(cand_pos_ptr + seq * capacity + place, pos, mask=keep & (place < capacity))

    @triton.jit(do_not_specialize=["num_seqs", "row_blocks", "cand_blocks", "k"])
    def _pass_kernel(scores_ptr, lens_ptr, cand_ptr, count_ptr, hist_ptr, state_ptr, stride_sb, width,
                     num_seqs, row_blocks, cand_blocks, k, capacity,
                     PASS: tl.constexpr, HAS_LENS: tl.constexpr, BLOCK: tl.constexpr,
                     SPARSE_FROM: tl.constexpr = 4, SPARSE_MAX: tl.constexpr = 64, PDL: tl.constexpr = 0):
        """The PASS-th byte histogram of wideep_kernels/radix_select.py's _radix_pass_kernel, over the row's
        candidates, or over the whole row where they did not fit: the program reads the row's
        count and takes its share (`cand_blocks` or `row_blocks` blocks) of the one or the other,
        up to the row's last candidate. From pass SPARSE_FROM on, a block where at most SPARSE_MAX
        keys still match adds them by atomics instead of a histogram of the block."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        if PASS > 0:  # before any program leaves: program 0 keeps the state for the next pass
            prefix, rank = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, PASS - 1)
            if tl.program_id(1) == 0:
                _keep_radix_state(state_ptr, seq, num_seqs, prefix, rank, PASS - 1)
            prefix = prefix.to(tl.uint32, bitcast=True)
        found = tl.load(count_ptr + seq)
        overflow = found > capacity
        if overflow:
            src = scores_ptr + seq * stride_sb
        else:
            src = cand_ptr + seq * capacity
        row_end, row_load_end = _live_end(lens_ptr, seq, width, HAS_LENS)
        end = tl.where(overflow, row_end, found)
        load_end = tl.where(overflow, row_load_end, tl.minimum(tl.cdiv(found, 16) * 16, capacity))
        # Fewer than k candidates only when the row has fewer than k finite scores: the places
        # up to k are its -inf scores (never loaded), so the k-th key is -inf's.
        counted = tl.where(overflow, width, tl.maximum(found, k))
        blocks = tl.where(overflow, row_blocks, cand_blocks)
        start = tl.program_id(1) * blocks * BLOCK
        if start >= counted:
            return
        # A prompt chunk's row has one program and a few thousand candidates in its 16K places:
        # the blocks past them hold none.
        counts = tl.zeros([256], dtype=tl.int32)
        for b in range(0, tl.minimum(blocks, tl.cdiv(counted - start, BLOCK))):
            pos = start + b * BLOCK + tl.arange(0, BLOCK)
            key = _order_key(_load_live(src, pos, end, load_end))
            digit = (key >> (24 - 8 * PASS)) & 0xFF
            match = pos < counted
            if PASS > 0:
                match = match & ((key >> (32 - 8 * PASS)) == prefix)
            counts = _count_digits(hist_ptr + (PASS * num_seqs + seq) * 256, counts, digit, match,
                                   PASS >= SPARSE_FROM, SPARSE_MAX, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (PASS * num_seqs + seq) * 256 + bins, counts, mask=counts > 0, sem="relaxed")


    @triton.jit
    def _load_candidates(row_ptr, row_pos_ptr, i, found):
        """Candidates i of a row (score -inf and position -1 from `found` on). The loads run to
        the next multiple of 16 (within the capacity, itself one), which keeps them vectorised."""
        load_end = tl.cdiv(found, 16) * 16
        s = tl.load(row_ptr + i, mask=i < load_end, other=float("-inf"))
        p = tl.load(row_pos_ptr + i, mask=i < load_end, other=-1)
        return tl.where(i < found, s, float("-inf")), tl.where(i < found, p, -1)

    @triton.jit
    def _count_ties_from(row_pos_ptr, row_ptr, found, kth, cut, BLOCK: tl.constexpr):
        """How many of the row's candidates score exactly kth at positions >= cut (>= 0)."""
        n = tl.zeros([], dtype=tl.int32)
        for b in range(0, found, BLOCK):
            s, p = _load_candidates(row_ptr, row_pos_ptr, b + tl.arange(0, BLOCK), found)
            n += tl.sum(((s == kth) & (p >= cut)).to(tl.int32), axis=0)
        return n

    @triton.jit(do_not_specialize=["num_seqs", "k", "topk", "width"])
    def _emit_candidates_kernel(cand_ptr, cand_pos_ptr, count_ptr, hist_ptr, state_ptr, out_ptr, stride_ob,
                                num_seqs, k, topk, width, capacity,
                                BLOCK: tl.constexpr, FILL: tl.constexpr, PDL: tl.constexpr = 0):
        """A row whose candidates fit: its top-k positions from them alone, the tie rule of
        select_topk_triton's emit pass (every position above the k-th score, then the latest
        positions scoring exactly it), -1 past the places filled. Rows that overflowed are left
        to the passes over the whole row."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        found = tl.load(count_ptr + seq)
        if found > capacity:
            return
        prefix, _ = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, 3)
        kth = _key_to_score(prefix.to(tl.uint32, bitcast=True))
        row = cand_ptr + seq * capacity
        row_pos = cand_pos_ptr + seq * capacity
        row_out = out_ptr + seq * stride_ob
        total_above = tl.zeros([], dtype=tl.int32)
        total_equal = tl.zeros([], dtype=tl.int32)
        for b in range(0, found, BLOCK):
            s, p = _load_candidates(row, row_pos, b + tl.arange(0, BLOCK), found)
            total_above += tl.sum((s > kth).to(tl.int32), axis=0)
            # (a k-th score of -inf, fewer than k finite ones, must not count the padding)
            total_equal += tl.sum(((s == kth) & (p >= 0)).to(tl.int32), axis=0)
        # Fewer than k places above the k-th score, by its definition.
        ties_wanted = tl.minimum(k - total_above, total_equal)
        cut = tl.zeros([], dtype=tl.int32)
        if ties_wanted < total_equal:
            # More ties than places (rare: scores equal to the k-th one): the latest ones, from the
            # largest cut keeping ties_wanted of them. Positions are distinct, so it keeps exactly
            # that many.
            lo = tl.zeros([], dtype=tl.int32)
            hi = width
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _count_ties_from(row_pos, row, found, kth, mid, BLOCK) >= ties_wanted:
                    lo = mid
                else:
                    hi = mid - 1
            cut = lo
        above_so_far = tl.zeros([], dtype=tl.int32)
        ties_so_far = tl.zeros([], dtype=tl.int32)
        for b in range(0, found, BLOCK):
            s, p = _load_candidates(row, row_pos, b + tl.arange(0, BLOCK), found)
            is_above = s > kth
            tl.store(row_out + above_so_far + tl.cumsum(is_above.to(tl.int32), axis=0) - 1, p, mask=is_above)
            is_tie = (s == kth) & (p >= cut)
            tl.store(row_out + total_above + ties_so_far + tl.cumsum(is_tie.to(tl.int32), axis=0) - 1, p,
                     mask=is_tie)
            above_so_far += tl.sum(is_above.to(tl.int32), axis=0)
            ties_so_far += tl.sum(is_tie.to(tl.int32), axis=0)
        filled = total_above + ties_wanted
        for start in range(0, topk, FILL):
            i = start + tl.arange(0, FILL)
            tl.store(row_out + i, tl.full([FILL], -1, tl.int32), mask=(i >= filled) & (i < topk))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_stride(width: int, k: int) -> int:
    """T: the number of groups, and the distance between a group's members. At least
    GROUPS_PER_K * k where the row is that wide, else the whole row (one position a group, the
    bound then exact); a multiple of GROUP_TILE, and >= k for every k <= width."""
    return min(_cdiv(GROUPS_PER_K * k, GROUP_TILE), _cdiv(width, GROUP_TILE)) * GROUP_TILE


def candidate_buffers(num_seqs: int, device, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores fp32, positions int32), [B, capacity] each: threshold_passes' candidates kept for
    emit_candidates."""
    capacity = _cdiv(capacity or CAPACITY, 16) * 16
    return (torch.empty(num_seqs, capacity, device=device, dtype=torch.float32),
            torch.empty(num_seqs, capacity, device=device, dtype=torch.int32))


def emit_candidates(candidates: tuple[torch.Tensor, torch.Tensor], count: torch.Tensor, hist: torch.Tensor,
                    state: torch.Tensor, out: torch.Tensor, k: int, width: int) -> None:
    """out[b] (int32 [B, topk]) = the top-k positions of each row whose candidates fit (count[b] <=
    capacity), from threshold_passes' hist, state and count with `candidates`; the other rows'
    places are left as they are."""
    cand, cand_pos = candidates
    num_seqs, capacity = cand.shape
    topk = out.shape[1]
    _emit_candidates_kernel[(num_seqs,)](
        cand, cand_pos, count, hist, state, out, out.stride(0), num_seqs, k, topk, width, capacity,
        BLOCK=BLOCK, FILL=min(1024, max(16, 1 << (topk - 1).bit_length())), num_warps=4, **pdl_launch(cand))


def threshold_workspace(num_seqs: int, device) -> torch.Tensor:
    """The int32 workspace threshold_passes takes zeroed with `maxima` (B rows of 8 * 256 + 1:
    the maxima's and the candidates' histograms, and the candidate counts)."""
    return torch.empty(num_seqs, 8 * 256 + 1, device=device, dtype=torch.int32)


def threshold_passes(scores: torch.Tensor, k: int, g_lens: torch.Tensor | None = None,
                     capacity: int | None = None, maxima: torch.Tensor | None = None,
                     ws: torch.Tensor | None = None,
                     candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hist [4, B, 256], state [3, 2, B], count [B]): the histograms and state of the k-th
    largest score of each row of scores [B, width] fp32 (1 <= k <= width), laid out as
    radix_passes' (wideep_kernels/radix_select.py), and each row's candidate count (> capacity: the row
    took the passes over all of it). g_lens int32 [B]: positions at or past it count as -inf
    whatever they hold (at most 15 of them are loaded, to keep the loads vectorised); without
    it the whole row is read. `capacity`: candidate places a row
    (default CAPACITY, rounded up to a multiple of 16; tests make rows overflow with a small
    one). `maxima` [B, T] with `ws` (threshold_workspace, zeroed): the rows' group maxima for a
    group stride T >= k, already taken (the scoring launch does: wideep_kernels/indexer.py), so the
    maxima's launch is left out. `candidates`: (scores, positions) buffers of
    candidate_buffers(B, capacity) that keep the candidates with their positions (for
    emit_candidates)."""
    num_seqs, width = scores.shape
    capacity = _cdiv(capacity or CAPACITY, 16) * 16  # row starts 64-byte aligned: vector loads
    device = scores.device
    if not 1 <= k <= width:
        raise ValueError(f"k must be in 1..{width}, got {k}")
    if scores.stride(1) != 1:
        raise ValueError("scores must be contiguous along a row")
    if (maxima is None) != (ws is None):
        raise ValueError("maxima and ws come together")
    if maxima is not None and (maxima.shape[0] != num_seqs or maxima.shape[1] < k):
        raise ValueError(f"maxima must be [{num_seqs}, T] with T >= k = {k}, got {tuple(maxima.shape)}")
    if candidates is not None and any(c.shape != (num_seqs, capacity) for c in candidates):
        raise ValueError(f"candidates must be two [{num_seqs}, {capacity}] buffers")
    # One allocation zeroed by the first launch: the maxima's histograms, the candidates'
    # histograms, the candidate counts.
    ws = (ws if ws is not None else threshold_workspace(num_seqs, device)).view(-1)
    hist_m = ws[:4 * num_seqs * 256].view(4, num_seqs, 256)
    hist = ws[4 * num_seqs * 256:8 * num_seqs * 256].view(4, num_seqs, 256)
    count = ws[8 * num_seqs * 256:]
    state = torch.empty(3, 2, num_seqs, device=device, dtype=torch.int32)
    if num_seqs == 0:
        return hist, state, count
    has_lens = g_lens is not None
    lens = g_lens.to(device=device, dtype=torch.int32).contiguous() if has_lens else count  # not read without
    m = maxima
    if m is None:
        stride = group_stride(width, k)
        m = torch.empty(num_seqs, stride, device=device, dtype=torch.float32)
        _group_max_kernel[(num_seqs, stride // GROUP_TILE)](
            scores, lens, m, ws, scores.stride(0), width, stride, _cdiv(width, stride), ws.numel(),
            HAS_LENS=has_lens, TILE=GROUP_TILE, ROWS=GROUP_ROWS, num_warps=4, **pdl_launch(scores))
    _, state_m = radix_passes(m, k, hist=hist_m, passes=MAXIMA_PASSES)

    if candidates is None:
        cand, cand_pos = torch.empty(num_seqs, capacity, device=device, dtype=torch.float32), count  # not written
    else:
        cand, cand_pos = candidates
    block = CANDIDATE_BLOCK
    parts = max(1, min(_cdiv(width, block), CANDIDATE_PROGRAMS // num_seqs))
    blocks = _cdiv(width, parts * block)
    _candidate_kernel[(num_seqs, _cdiv(width, blocks * block))](
        scores, lens, hist_m, state_m, count, cand, cand_pos, scores.stride(0), width, num_seqs, blocks, k, capacity,
        HAS_LENS=has_lens, BLOCK=block, POSITIONS=candidates is not None, BOUND_PASS=MAXIMA_PASSES - 1,
        num_warps=CANDIDATE_WARPS, num_stages=CANDIDATE_STAGES, **pdl_launch(scores))

    # The programs of a row cover both all of it and the most candidates a pass can read (never
    # more than the row's positions; at least k, the -inf places).
    parts = max(1, min(_cdiv(width, BLOCK), PASS_PROGRAMS // num_seqs))
    row_blocks = _cdiv(width, parts * BLOCK)
    cand_blocks = _cdiv(min(max(capacity, k), width), parts * BLOCK)
    for p in range(4):
        _pass_kernel[(num_seqs, parts)](
            scores, lens, cand, count, hist, state, scores.stride(0), width, num_seqs, row_blocks, cand_blocks, k,
            capacity, PASS=p, HAS_LENS=has_lens, BLOCK=BLOCK, SPARSE_FROM=PASS_SPARSE_FROM,
            SPARSE_MAX=PASS_SPARSE_MAX, num_warps=8, **pdl_launch(scores))
    return hist, state, count
