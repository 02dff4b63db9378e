"""The multi-launch top-k of wide rows (wideep_kernels/indexer.py select_topk_triton past the one-launch
select): four byte-histogram passes over the scores' order keys find each row's k-th score
(radix_passes; wideep_kernels/wide_select.py runs the same passes over candidates), then the positions
are emitted in one launch from the last histogram (_emit_rows_kernel) or, with the k-th score
from elsewhere, by a count, an offsets and an emit pass over chunks of the row.
"""
from __future__ import annotations

import os

import torch

from .index_score import _next_pow2
from .row_select import SPARSE_MAX, SPARSE_MAX_ROWS

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # a CPU-only install without triton: wideep_kernels/indexer.py uses its reference
    triton = None
    tl = None

# The radix passes want enough programs to fill the GPU: rows are split finer (down to one block
# a program) until there are this many. 1024 against 128 (bench.probe_radix on the H200, all four
# passes): batch 64 at 8K 33.2 -> 28.1 us, batch 16 at 128K 59.4 -> 55.9 us; batch 1 and 16 at 8K
# reach one block a program either way.
_RADIX_PROGRAMS = 1024
# The radix passes' last two bytes: blocks where few keys still match add them by atomics, as the
# one-launch select does (wideep_kernels/row_select.py SPARSE_FROM); WIDEEP_RADIX_SPARSE=0 keeps the
# histograms.
RADIX_SPARSE = os.environ.get("WIDEEP_RADIX_SPARSE", "1") != "0"
_SELECT_BLOCK = 1024


if triton is not None:
    from .row_select import _key_to_score, _order_key, _pick_digit

    # Integer arguments that are 1 or a multiple of 16 get their own build unless listed in
    # do_not_specialize; chunk counts change as contexts grow, so they are listed (they only
    # index scalars) and a longer context never stalls decode on a build.
    @triton.jit
    def _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, PASS: tl.constexpr):
        """After the PASS-th histogram: the top 8 * (PASS + 1) bits of the row's k-th largest key
        (`prefix`, int32 bits) and its rank among the keys sharing them (1 = the largest), from
        that histogram and the state after the pass before (state[p] = (prefix, rank) of rows).
        Every program of the next pass derives it (a 256-bin read), and its first program stores
        it for the pass after: no launch of its own between passes."""
        if PASS == 0:
            prefix = tl.zeros([], dtype=tl.int32)
            rank = k
        else:
            prefix = tl.load(state_ptr + ((PASS - 1) * 2) * num_seqs + seq)
            rank = tl.load(state_ptr + ((PASS - 1) * 2 + 1) * num_seqs + seq)
        h = tl.load(hist_ptr + (PASS * num_seqs + seq) * 256 + tl.arange(0, 256))
        digit, rank = _pick_digit(h, rank)
        return (prefix << 8) | digit, rank

    @triton.jit
    def _keep_radix_state(state_ptr, seq, num_seqs, prefix, rank, PASS: tl.constexpr):
        tl.store(state_ptr + (PASS * 2) * num_seqs + seq, prefix)
        tl.store(state_ptr + (PASS * 2 + 1) * num_seqs + seq, rank)

    @triton.jit(do_not_specialize=["num_seqs", "k"])
    def _radix_kth_kernel(hist_ptr, state_ptr, kth_ptr, num_seqs, k, PDL: tl.constexpr = 0):
        """The k-th score of each row from the last histogram (kth_scores called on its own)."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        prefix, _ = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, 3)
        tl.store(kth_ptr + seq, _key_to_score(prefix.to(tl.uint32, bitcast=True)))

    @triton.jit
    def _matching_histogram(digit, match, BLOCK: tl.constexpr):
        """The histogram [256] of the digits of a block's matching keys. The others land in bin 0
        and are taken out of it again, so that every bin is exact: the one-launch emit reads the
        k-th key's own bin as its count of ties."""
        h = tl.histogram(tl.where(match, digit, 0).to(tl.int32), 256)
        return h - tl.where(tl.arange(0, 256) == 0, BLOCK - tl.sum(match.to(tl.int32), axis=0), 0)

    @triton.jit
    def _count_digits(hist_row_ptr, counts, digit, match, SPARSE: tl.constexpr, SPARSE_MAX: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Count a block's matching digits: SPARSE, where at most SPARSE_MAX keys match, by atomics
        straight into the row's histogram; else into the program's `counts`, which it returns."""
        if SPARSE:
            if tl.sum(match.to(tl.int32), axis=0) <= SPARSE_MAX:
                tl.atomic_add(hist_row_ptr + digit, tl.full([BLOCK], 1, tl.int32), mask=match, sem="relaxed")
            else:
                counts += _matching_histogram(digit, match, BLOCK)
        else:
            counts += _matching_histogram(digit, match, BLOCK)
        return counts

    @triton.jit(do_not_specialize=["num_seqs", "span", "k"])
    def _radix_pass_kernel(scores_ptr, hist_ptr, state_ptr, stride_sb, width, num_seqs, span, k,
                           PASS: tl.constexpr, BLOCK: tl.constexpr, SPARSE: tl.constexpr = False,
                           SPARSE_MAX: tl.constexpr = 64, PDL: tl.constexpr = 0):
        """Histogram of the PASS-th byte (from the top) of the keys that match the k-th
        largest key in the bytes before it, over `span` positions of the row; counts are added
        into hist[PASS, seq]. The span is a runtime loop, not a block size, so one build serves
        every batch size and context. SPARSE: from the third byte on, a block where at most
        SPARSE_MAX keys still match adds them by atomics instead of a histogram of the block."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        start = tl.program_id(1) * span
        if PASS > 0:
            prefix, rank = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, PASS - 1)
            if tl.program_id(1) == 0:
                _keep_radix_state(state_ptr, seq, num_seqs, prefix, rank, PASS - 1)
            prefix = prefix.to(tl.uint32, bitcast=True)
        counts = tl.zeros([256], dtype=tl.int32)
        for off in range(0, span, BLOCK):
            # spans are whole blocks (radix_passes): the hint lets the loads vectorise, which the
            # unspecialised span alone would not
            pos = tl.multiple_of(start + off, BLOCK) + tl.arange(0, BLOCK)
            s = tl.load(scores_ptr + seq * stride_sb + pos, mask=pos < width, other=float("-inf"))
            key = _order_key(s)
            digit = (key >> (24 - 8 * PASS)) & 0xFF
            match = pos < width
            if PASS > 0:
                match = match & ((key >> (32 - 8 * PASS)) == prefix)
            if PASS >= 2:
                counts = _count_digits(hist_ptr + (PASS * num_seqs + seq) * 256, counts, digit, match, SPARSE,
                                       SPARSE_MAX, BLOCK)
            else:
                counts += _matching_histogram(digit, match, BLOCK)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (PASS * num_seqs + seq) * 256 + bins, counts, mask=counts > 0, sem="relaxed")

    @triton.jit
    def _live_scores(row_ptr, pos, live, width):
        """A row's scores at `pos`, -inf where not `live`. The load is masked by the row's width
        alone, a multiple of 16, so it is a vector load; a mask by g_len (any value) would split
        it into one load a score. Past g_len the row holds anything, never NaN-checked: `live`
        replaces it."""
        s = tl.load(row_ptr + pos, mask=pos < width, other=float("-inf"))
        return tl.where(live, s, float("-inf"))

    @triton.jit(do_not_specialize=["stride_cb", "num_seqs", "k"])
    def _count_chunk_kernel(scores_ptr, kth_ptr, lens_ptr, above_ptr, equal_ptr, hist_ptr, state_ptr,
                            found_ptr, capacity, stride_sb, stride_cb, width, num_seqs, k,
                            CHUNK: tl.constexpr, RADIX: tl.constexpr, FITTED: tl.constexpr = False,
                            PDL: tl.constexpr = 0):
        """Program (seq, p) counts chunks p, p + P, ... of its row (P programs a row).
        FITTED: rows whose threshold candidates fit (found <= capacity) were emitted from them
        (wideep_kernels/wide_select.py emit_candidates) and are skipped here, in the offsets and the
        emit pass."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        if FITTED:
            if tl.load(found_ptr + seq) <= capacity:
                return
        g_len = tl.load(lens_ptr + seq)
        if RADIX:  # the k-th score from the radix passes' last histogram; kept for the emit pass
            prefix, _ = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, 3)
            kth = _key_to_score(prefix.to(tl.uint32, bitcast=True))
            if tl.program_id(1) == 0:
                tl.store(kth_ptr + seq, kth)
        else:
            kth = tl.load(kth_ptr + seq)
        for chunk in range(tl.program_id(1), tl.cdiv(width, CHUNK), tl.num_programs(1)):
            pos = chunk * CHUNK + tl.arange(0, CHUNK)
            live = (pos < g_len) & (pos < width)
            s = _live_scores(scores_ptr + seq * stride_sb, pos, live, width)
            tl.store(above_ptr + seq * stride_cb + chunk, tl.sum((live & (s > kth)).to(tl.int32), axis=0))
            tl.store(equal_ptr + seq * stride_cb + chunk, tl.sum((live & (s == kth)).to(tl.int32), axis=0))

    @triton.jit(do_not_specialize=["stride_cb", "num_chunks"])
    def _chunk_offsets_kernel(above_ptr, equal_ptr, before_ptr, after_ptr, found_ptr, capacity, stride_cb, num_chunks,
                              SUMS: tl.constexpr, FITTED: tl.constexpr = False, PDL: tl.constexpr = 0):
        """Per row: before[c] = positions above the k-th score in the chunks before c, after[c] =
        positions equal to it in the chunks after c; column num_chunks holds the row's totals.
        Once a row here, so the emit pass's programs each read two numbers, not every chunk's
        counts (at 512K that summing was most of the emit's 45 us a layer). SUMS chunks a step:
        one build serves every width."""
        pdl_enter(PDL)
        if FITTED:
            if tl.load(found_ptr + tl.program_id(0)) <= capacity:
                return
        row = tl.program_id(0) * stride_cb
        total_equal = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, num_chunks, SUMS):
            c = c0 + tl.arange(0, SUMS)
            total_equal += tl.sum(tl.load(equal_ptr + row + c, mask=c < num_chunks, other=0), axis=0)
        above_so_far = tl.zeros([], dtype=tl.int32)
        equal_so_far = tl.zeros([], dtype=tl.int32)
        for c0 in range(0, num_chunks, SUMS):
            c = c0 + tl.arange(0, SUMS)
            c_ok = c < num_chunks
            above = tl.load(above_ptr + row + c, mask=c_ok, other=0)
            equal = tl.load(equal_ptr + row + c, mask=c_ok, other=0)
            tl.store(before_ptr + row + c, above_so_far + tl.cumsum(above, axis=0) - above, mask=c_ok)
            tl.store(after_ptr + row + c, total_equal - equal_so_far - tl.cumsum(equal, axis=0), mask=c_ok)
            above_so_far += tl.sum(above, axis=0)
            equal_so_far += tl.sum(equal, axis=0)
        tl.store(before_ptr + row + num_chunks, above_so_far)
        tl.store(after_ptr + row + num_chunks, total_equal)

    @triton.jit(do_not_specialize=["stride_cb", "num_chunks", "k"])
    def _emit_chunk_kernel(scores_ptr, kth_ptr, lens_ptr, before_ptr, after_ptr, out_ptr, found_ptr, capacity,
                           stride_sb, stride_cb, stride_ob, width, num_chunks, k, topk,
                           CHUNK: tl.constexpr, FILL: tl.constexpr, FITTED: tl.constexpr = False,
                           PDL: tl.constexpr = 0):
        """Program (seq, p) emits chunks p, p + P, ... of its row (P programs a row)."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        if FITTED:
            if tl.load(found_ptr + seq) <= capacity:
                return
        row = seq * stride_cb
        total_above = tl.load(before_ptr + row + num_chunks)
        total_equal = tl.load(after_ptr + row + num_chunks)
        # Everything above the k-th score is kept; the remaining places go to the scores equal
        # to it, latest position first.
        ties_wanted = k - total_above
        g_len = tl.load(lens_ptr + seq)
        kth = tl.load(kth_ptr + seq)
        row_out = out_ptr + seq * stride_ob
        for chunk in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
            above_before = tl.load(before_ptr + row + chunk)
            ties_after = tl.load(after_ptr + row + chunk)
            pos = chunk * CHUNK + tl.arange(0, CHUNK)
            live = (pos < g_len) & (pos < width)
            s = _live_scores(scores_ptr + seq * stride_sb, pos, live, width)
            is_above = live & (s > kth)
            above_rank = above_before + tl.cumsum(is_above.to(tl.int32), axis=0) - 1
            tl.store(row_out + above_rank, pos, mask=is_above)
            is_tie = (live & (s == kth)).to(tl.int32)
            later_ties = ties_after + tl.sum(is_tie, axis=0) - tl.cumsum(is_tie, axis=0)
            take = (is_tie != 0) & (later_ties < ties_wanted)
            tl.store(row_out + total_above + later_ties, pos, mask=take)

        if tl.program_id(1) == 0:
            filled = total_above + tl.minimum(ties_wanted, total_equal)
            for start in range(0, topk, FILL):
                i = start + tl.arange(0, FILL)
                tl.store(row_out + i, tl.full([FILL], -1, tl.int32), mask=(i >= filled) & (i < topk))


    @triton.jit(do_not_specialize=["num_seqs", "k", "topk"])
    def _emit_rows_kernel(scores_ptr, lens_ptr, hist_ptr, state_ptr, slots_ptr, out_ptr, found_ptr, capacity,
                          stride_sb, stride_ob, width, num_seqs, k, topk,
                          CHUNK: tl.constexpr, FILL: tl.constexpr, FITTED: tl.constexpr = False,
                          PDL: tl.constexpr = 0):
        """The positions of each row's top k in one pass, from the radix passes' histograms and
        state alone: the last pass gives the k-th score's key, how many of the positions scoring
        exactly it are wanted (its rank among them) and how many there are (its bin). Program
        (seq, p) takes chunks p, p + P, ... and appends their positions above the k-th score at
        places counted by an atomic (slots[seq, 0], zeroed), and, where every tie is wanted,
        their ties after those (slots[seq, 1]). Where fewer ties are wanted than there are (scores equal to the k-th,
        rare past relu's zeros), program 0 takes the latest ones, scanning back from g_len: one
        program reading the row, up to about 300 us at 512K on the H200 where the ties lie far
        back (when bin 0 was not exact, a k-th key ending in a 0 byte took this path too).
        FITTED: rows whose threshold candidates fit were emitted from them and are skipped."""
        pdl_enter(PDL)
        seq = tl.program_id(0)
        if FITTED:
            if tl.load(found_ptr + seq) <= capacity:
                return
        g_len = tl.minimum(tl.load(lens_ptr + seq), width)
        prefix, ties_wanted = _radix_state(hist_ptr, state_ptr, seq, num_seqs, k, 3)
        kth = _key_to_score(prefix.to(tl.uint32, bitcast=True))
        total_above = k - ties_wanted
        ties = tl.load(hist_ptr + (3 * num_seqs + seq) * 256 + (prefix & 0xFF))
        # A k-th score of -inf (fewer than k live positions): the places left stay -1.
        ties_wanted = tl.where(kth > float("-inf"), ties_wanted, 0)
        every_tie = ties == ties_wanted
        row = scores_ptr + seq * stride_sb
        row_out = out_ptr + seq * stride_ob
        for chunk in range(tl.program_id(1), tl.cdiv(g_len, CHUNK), tl.num_programs(1)):
            pos = chunk * CHUNK + tl.arange(0, CHUNK)
            live = pos < g_len
            s = _live_scores(row, pos, live, width)
            is_above = (live & (s > kth)).to(tl.int32)
            n = tl.sum(is_above, axis=0)
            if n > 0:
                place = tl.atomic_add(slots_ptr + seq * 2, n, sem="relaxed") + tl.cumsum(is_above, axis=0) - 1
                tl.store(row_out + place, pos, mask=is_above != 0)
            if every_tie:
                is_tie = (live & (s == kth)).to(tl.int32)
                n = tl.sum(is_tie, axis=0)
                if n > 0:
                    place = tl.atomic_add(slots_ptr + seq * 2 + 1, n, sem="relaxed") + tl.cumsum(is_tie, axis=0) - 1
                    tl.store(row_out + total_above + place, pos, mask=is_tie != 0)
        if tl.program_id(1) == 0:
            if (every_tie == 0) & (ties_wanted > 0):
                taken = tl.zeros([], dtype=tl.int32)
                c = tl.cdiv(g_len, CHUNK) - 1
                while (taken < ties_wanted) & (c >= 0):
                    pos = c * CHUNK + tl.arange(0, CHUNK)
                    live = pos < g_len
                    is_tie = (live & (_live_scores(row, pos, live, width) == kth)).to(tl.int32)
                    later = taken + tl.sum(is_tie, axis=0) - tl.cumsum(is_tie, axis=0)  # ties past each
                    tl.store(row_out + total_above + later, pos, mask=(is_tie != 0) & (later < ties_wanted))
                    taken += tl.sum(is_tie, axis=0)
                    c -= 1
            filled = total_above + ties_wanted
            for start in range(0, topk, FILL):
                i = start + tl.arange(0, FILL)
                tl.store(row_out + i, tl.full([FILL], -1, tl.int32), mask=(i >= filled) & (i < topk))


def radix_passes(scores: torch.Tensor, k: int, span: int | None = None, block: int | None = None,
                 num_warps: int = 8, hist: torch.Tensor | None = None,
                 sparse: bool | None = None, passes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The four histogram passes of the radix select: (hist [4, B, 256], state [3, 2, B]), from
    which _radix_state derives the k-th score (kth_scores; the count pass of select_topk_triton).
    `hist`: histograms already zeroed (the scoring launch can do it). (The scoring launch taking
    the first histogram too, with the workspace zeroed before it, was slower on the H200: batch
    1 at 512K 1.749 against 1.631 ms a step; RESULTS, seventeenth session.) `sparse`: the last two
    passes count blocks with few matching keys by atomics (default RADIX_SPARSE, up to
    SPARSE_MAX_ROWS rows). `passes` < 4: only the first bytes (the threshold select's bound needs
    two)."""
    num_seqs, width = scores.shape
    if sparse is None:
        sparse = RADIX_SPARSE and num_seqs <= SPARSE_MAX_ROWS
    if hist is None:
        hist = torch.zeros(4, num_seqs, 256, device=scores.device, dtype=torch.int32)
    state = torch.empty(3, 2, num_seqs, device=scores.device, dtype=torch.int32)
    # Fixed block sizes (short rows are masked): one build per pass for every width.
    block = block or _SELECT_BLOCK
    if span is None:
        span = max(block, min(4096, _next_pow2(width, 16)))
        while span > block and num_seqs * triton.cdiv(width, span) < _RADIX_PROGRAMS:
            span //= 2
    if span % block:
        raise ValueError(f"span {span} must be a multiple of block {block}")
    for p in range(passes):
        _radix_pass_kernel[(num_seqs, triton.cdiv(width, span))](
            scores, hist, state, scores.stride(0), width, num_seqs, span, k, PASS=p, BLOCK=block,
            SPARSE=sparse, SPARSE_MAX=SPARSE_MAX, num_warps=num_warps, **pdl_launch(scores))
    return hist, state
