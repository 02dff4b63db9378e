"""The indexer's top-k selection in one launch: radix select, count and emit, with the programs
that share a row meeting at a barrier between phases instead of at a kernel boundary.

The multi-launch selection in wideep_kernels/radix_select.py (four histogram passes, a count pass and an
emit pass) spends most of its time at short contexts on six dependent launches of a few
microseconds each, not on the 32 KB a row it reads. Here each row is split over `parts`
programs (a span of positions each) that run six phases:

    0-3  histogram of one byte (from the top) of the order keys that still match the k-th
         largest key's bytes so far, added into the row's histogram of that byte;
    4    count, in the program's span, the scores above the k-th and equal to it (from what
         phase 3 kept where it can: RECORDS below);
    5    emit the span's positions: above the k-th at their rank among the row's, then the
         latest positions equal to it into the places left (the reference's tie rule).

A row with no more live positions than k takes them all, with no phase.
Positions at or past a row's length (g_len) are never read: they count as -inf keys, added by
the row's last live part, and parts holding only such positions leave at once.

Between phases the row's live programs wait on a counter (`_row_barrier`). They can only all be
running together if the programs that wait were not started before their partners could be:
each program takes its (row, part) from a ticket counter in the order it started, so the
programs a waiting one depends on were started no later than it was. A row has at most
MAX_PARTS programs of four warps, far fewer than one GPU holds at once.

The Triton interpreter runs programs one after another, where a barrier would never open; there
(and on request, `phased=True`) each phase is its own launch of the same kernel, and the phase
code is the same.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from .pdl import pdl_enter, pdl_launch
except Exception:  # a CPU-only install without triton: wideep_kernels/indexer.py uses the reference
    triton = None
    tl = None

# Programs a row is split over, at most; also the width of the per-part count arrays (one build).
MAX_PARTS = 64
# Positions a program loads per step: spans are whole multiples of it (one build for every width).
BLOCK = 512
# Rows are split so that there are about this many programs in all, each covering at least
# BLOCK positions: the batch-64 decode step took 4.538 ms with 2048 against 4.657 with 512
# (RESULTS, ninth session, run 4).
TARGET_PROGRAMS = 2048
# From this byte pass on, a block where at most SPARSE_MAX keys still match adds them by atomics,
# for batches of up to SPARSE_MAX_ROWS rows. On the H200 at the decode step's row width for 8K
# (10240, 8193 live; bench.probe_select) that took 16.1 against 18.2 us at batch 16 and 23.2
# against 28.6 at 64, and the batch-64 step 4.36 against 4.44 ms (RESULTS, twelfth session). Rows
# past 64 are unmeasured, so they keep the histograms in wideep_kernels/radix_select.py's passes.
# Here they take the atomics at any number of rows: at 256 rows (decode, 10240 wide) 66.0 against
# 85.8 us on the H200; and steps of MANY_ROWS rows or more (prompt chunks) from the second byte
# pass, up to 256 keys a block: 1,024 rows of 32K, 501 us against 577 from the third byte pass and
# 824 with histograms only (RESULTS, forty-third session).
SPARSE_FROM = 2
SPARSE_MAX = 64
SPARSE_MAX_ROWS = 64
MANY_ROWS = 512
MANY_SPARSE_FROM = 1
MANY_SPARSE_MAX = 256
# Each phase reads the rows again. Programs start in ticket order, so the rows being worked on
# at once are about RESIDENT_PROGRAMS / parts, and steps of many wide rows (prompt chunks) are
# split so that those rows' scores stay within L2_ROW_BYTES, for the later phases to find them in
# the L2: 1,024 rows of 32K took 501 us in 4 parts against 532 in 8 (RESULTS, forty-third
# session). WIDEEP_SELECT_L2_MB=0 turns it off.
RESIDENT_PROGRAMS = 2048
L2_ROW_BYTES = int(os.environ.get("WIDEEP_SELECT_L2_MB", "64")) << 20
_HIST = 4 * 256
# The last byte pass also counts, for each part, the keys above the k-th's top three bytes and the
# keys sharing them, and keeps the positions of the first RECORDS of those. Where they fit, the count
# phase reads those few scores instead of the part's span again. WIDEEP_SELECT_RECORD=0 turns it off.
RECORDS = 8
RECORD = os.environ.get("WIDEEP_SELECT_RECORD", "1") != "0"
# A row's zeroed workspace: histograms, counts, barrier, the last pass's counts and positions;
# the ticket is the last entry of row 0's.
WORKSPACE_COLS = _HIST + 4 * MAX_PARTS + MAX_PARTS * RECORDS + 2
_PHASES = 6

if triton is not None:

    @triton.jit
    def _order_key(s):
        """fp32 -> uint32 whose unsigned order is the float order (-inf lowest). -0.0 takes
        0.0's key: they are equal scores, so that a count of the keys equal to the k-th one is
        also a count of the scores equal to it (wideep_kernels/radix_select.py _emit_rows_kernel)."""
        bits = tl.where(s == 0.0, 0.0, s).to(tl.uint32, bitcast=True)
        return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)

    @triton.jit
    def _pick_digit(h, rank):
        """Histogram h [256] of one byte of the keys still in the running: the byte of the
        rank-th largest of them, and that key's rank among the keys sharing the byte."""
        d = tl.arange(0, 256)
        from_top = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys with digit >= d
        digit = tl.max(tl.where(from_top >= rank, d, -1), axis=0)
        return digit, rank - tl.sum(tl.where(d > digit, h, 0), axis=0)

    @triton.jit
    def _key_to_score(key):
        bits = tl.where((key >> 31) != 0, key ^ 0x80000000, ~key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _row_barrier(sync_ptr, target):
        """Wait until the row's counter reaches `target`, after adding this program's arrival.
        The CTA barrier before the release orders every thread's writes of the phase (the
        histogram atomics, the counts) before the arrival; the acquire and the barrier after
        order the next phase's reads after every partner's arrival."""
        tl.debug_barrier()
        tl.atomic_add(sync_ptr, 1, sem="release")
        while tl.atomic_add(sync_ptr, 0, sem="acquire") < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _hist_digit(hist_ptr, prefix, rank, PASS: tl.constexpr):
        # .cg: the histogram was read before this phase's partners finished adding into it, and
        # L1 is not coherent between SMs.
        h = tl.load(hist_ptr + PASS * 256 + tl.arange(0, 256), cache_modifier=".cg")
        digit, rank = _pick_digit(h, rank)
        return (prefix << 8) | digit.to(tl.uint32), rank

    @triton.jit(do_not_specialize=["num_seqs", "parts", "span", "k", "topk"])
    def _select_kernel(scores_ptr, lens_ptr, out_ptr, ws_ptr, stride_sb, stride_ob, stride_wb,
                       width, num_seqs, parts, span, k, topk,
                       FIRST: tl.constexpr, LAST: tl.constexpr, BLOCK: tl.constexpr,
                       PARTS: tl.constexpr, FILL: tl.constexpr, SPARSE_FROM: tl.constexpr,
                       SPARSE_MAX: tl.constexpr, RECORD: tl.constexpr, REC: tl.constexpr, PDL: tl.constexpr = 0):
        """Phases FIRST..LAST of the selection (see the module docstring). ws [B, row] int32,
        zeroed: per row the four byte histograms, the per-part above and equal counts, the
        barrier counter, the last pass's per-part counts and positions (RECORD); ws[0, -1] the
        ticket counter."""
        pdl_enter(PDL)
        if FIRST == LAST:  # a launch per phase: nobody waits on a partner
            ticket = tl.program_id(0)
        else:
            ticket = tl.atomic_add(ws_ptr + stride_wb - 1, 1)
        seq = ticket // parts
        part = ticket % parts
        row_ws = ws_ptr + seq * stride_wb
        hist_ptr = row_ws
        above_ptr = row_ws + 4 * 256
        equal_ptr = above_ptr + PARTS
        sync_ptr = equal_ptr + PARTS
        gt_ptr = sync_ptr + 1  # per part: keys above the k-th's top three bytes, keys sharing them
        shared_ptr = gt_ptr + PARTS
        rec_ptr = shared_ptr + PARTS + part * REC  # the part's first REC of those sharing them
        row_scores = scores_ptr + seq * stride_sb
        start = part * span
        g_len = tl.load(lens_ptr + seq)
        # Only positions below g_len are read. A decode step's rows are as wide as its longest
        # sequence's table padded to a graph's bucket (up to 1.25x), and shorter rows have more
        # past their length. Those positions count as -inf keys without a load (the last live
        # part adds them), and the parts that hold only them leave at once: the row's barriers
        # wait for its live parts alone (part 0 always, which fills the unused places).
        # (The loads masked by g_len are one load a score. Masked by the width and vectorised, as
        # wideep_kernels/indexer.py's chunk passes are, the kernel took 10 more registers and the batch-64
        # select went from 23.2 to 33.1 us on the H200: its programs no longer fit in one wave.)
        live_end = tl.minimum(g_len, width)
        live_parts = tl.maximum(tl.cdiv(live_end, span), 1)
        if part >= live_parts:
            return
        live_span = tl.maximum(tl.minimum(span, live_end - start), 0)
        row_out = out_ptr + seq * stride_ob
        if live_end <= k:
            # Every live position is chosen (a short sequence among long ones, a prompt's early
            # rows): no pass needed. The first launch writes them; the phased form's later ones leave.
            if FIRST == 0:
                for off in range(0, live_span, BLOCK):
                    pos = start + off + tl.arange(0, BLOCK)
                    tl.store(row_out + pos, pos, mask=pos < live_end)
                if part == 0:
                    for fill_start in range(0, topk, FILL):
                        i = fill_start + tl.arange(0, FILL)
                        tl.store(row_out + i, tl.full([FILL], -1, tl.int32), mask=(i >= live_end) & (i < topk))
            return
        dead = tl.where(part == live_parts - 1, width - live_end, 0)

        # The k-th largest key's bytes known when phase FIRST starts (a launch of its own
        # re-reads them; within one launch they are carried from phase to phase).
        prefix = tl.zeros([], dtype=tl.uint32)
        rank = k
        for p in tl.static_range(4):
            if p < FIRST:
                prefix, rank = _hist_digit(hist_ptr, prefix, rank, p)

        for phase in tl.static_range(FIRST, LAST + 1):
            if phase > FIRST:
                _row_barrier(sync_ptr, live_parts * (phase - FIRST))
                if phase <= 4:
                    prefix, rank = _hist_digit(hist_ptr, prefix, rank, phase - 1)
            if phase < 4:
                bins = tl.arange(0, 256)
                # The dead positions' key, _order_key(-inf), where it still matches the prefix.
                dead_key = 0x007FFFFF
                if phase == 0:
                    dead_match = dead > 0
                else:
                    dead_match = (dead > 0) & ((dead_key >> (32 - 8 * phase)) == prefix)
                dead_byte = (dead_key >> (24 - 8 * phase)) & 0xFF
                counts = tl.where(dead_match & (bins == dead_byte), dead, 0).to(tl.int32)
                n_gt = tl.zeros([], dtype=tl.int32)
                n_shared = tl.zeros([], dtype=tl.int32)
                for off in range(0, live_span, BLOCK):
                    pos = start + off + tl.arange(0, BLOCK)
                    in_row = pos < live_end
                    s = tl.load(row_scores + pos, mask=in_row, other=float("-inf"))
                    key = _order_key(s)
                    if RECORD and phase == 3:
                        # Above the top three bytes: above the k-th, whatever its last byte (NaN
                        # never counts, as in the count phase's float comparisons).
                        n_gt += tl.sum((in_row & (s == s) & ((key >> 8) > prefix)).to(tl.int32), axis=0)
                        is_shared = in_row & ((key >> 8) == prefix)
                        n_blk = tl.sum(is_shared.to(tl.int32), axis=0)
                        if n_blk > 0:
                            slot = n_shared + tl.cumsum(is_shared.to(tl.int32), axis=0) - 1
                            tl.store(rec_ptr + slot, pos, mask=is_shared & (slot < REC))
                        n_shared += n_blk
                    match = in_row
                    if phase > 0:
                        match = match & ((key >> (32 - 8 * phase)) == prefix)
                    # Keys that do not match land in bin 0, which _pick_digit never needs exactly
                    # (wideep_kernels/radix_select.py, _radix_pass_kernel).
                    byte = (key >> (24 - 8 * phase)) & 0xFF
                    if phase >= SPARSE_FROM:
                        # Past the top two bytes few keys still match (tens in a row of 8K): one
                        # atomic each is cheaper than a histogram of the whole block.
                        if tl.sum(match.to(tl.int32), axis=0) <= SPARSE_MAX:
                            tl.atomic_add(hist_ptr + phase * 256 + byte, tl.full([BLOCK], 1, tl.int32),
                                          mask=match, sem="relaxed")
                        else:
                            counts += tl.histogram(tl.where(match, byte, 0).to(tl.int32), 256)
                    else:
                        counts += tl.histogram(tl.where(match, byte, 0).to(tl.int32), 256)
                tl.atomic_add(hist_ptr + phase * 256 + bins, counts, mask=counts > 0, sem="relaxed")
                if RECORD and phase == 3:
                    tl.store(gt_ptr + part, n_gt)
                    tl.store(shared_ptr + part, n_shared)
            elif phase == 4:
                kth = _key_to_score(prefix)
                n_shared = tl.full([], REC + 1, tl.int32)  # without RECORD: never kept, the span again
                if RECORD:
                    n_shared = tl.load(shared_ptr + part, cache_modifier=".cg")
                if (n_shared <= REC) & (kth == kth):
                    # The part's keys above the k-th: those above its top three bytes, and those
                    # of the few sharing them whose score is above it; the equal ones among them.
                    r = tl.arange(0, REC)
                    kept = r < n_shared
                    at = tl.load(rec_ptr + r, mask=kept, other=0, cache_modifier=".cg")
                    s = tl.load(row_scores + at, mask=kept, other=0.0)
                    n_above = tl.load(gt_ptr + part, cache_modifier=".cg") + tl.sum((kept & (s > kth)).to(tl.int32), axis=0)
                    n_equal = tl.sum((kept & (s == kth)).to(tl.int32), axis=0)
                else:
                    n_above = tl.zeros([], dtype=tl.int32)
                    n_equal = tl.zeros([], dtype=tl.int32)
                    for off in range(0, live_span, BLOCK):
                        pos = start + off + tl.arange(0, BLOCK)
                        live = pos < live_end
                        s = tl.load(row_scores + pos, mask=live, other=float("-inf"))
                        n_above += tl.sum((live & (s > kth)).to(tl.int32), axis=0)
                        n_equal += tl.sum((live & (s == kth)).to(tl.int32), axis=0)
                tl.store(above_ptr + part, n_above)
                tl.store(equal_ptr + part, n_equal)
            else:
                kth = _key_to_score(prefix)
                c = tl.arange(0, PARTS)
                c_ok = c < live_parts
                above = tl.load(above_ptr + c, mask=c_ok, other=0, cache_modifier=".cg")
                equal = tl.load(equal_ptr + c, mask=c_ok, other=0, cache_modifier=".cg")
                total_above = tl.sum(above, axis=0)
                total_equal = tl.sum(equal, axis=0)
                ranked = tl.sum(tl.where(c < part, above, 0), axis=0)  # above-k-th positions emitted before
                later_ties = tl.sum(tl.where(c >= part, equal, 0), axis=0)  # ties from this span on
                ties_wanted = k - total_above
                for off in range(0, live_span, BLOCK):
                    pos = start + off + tl.arange(0, BLOCK)
                    live = pos < live_end
                    s = tl.load(row_scores + pos, mask=live, other=float("-inf"))
                    is_above = live & (s > kth)
                    tl.store(row_out + ranked + tl.cumsum(is_above.to(tl.int32), axis=0) - 1, pos, mask=is_above)
                    ranked += tl.sum(is_above.to(tl.int32), axis=0)
                    # later_ties: ties at this block's positions and after; each tie's own count
                    # of later ties decides whether it gets one of the places left.
                    is_tie = (live & (s == kth)).to(tl.int32)
                    after = later_ties - tl.cumsum(is_tie, axis=0)
                    take = (is_tie != 0) & (after < ties_wanted)
                    tl.store(row_out + total_above + after, pos, mask=take)
                    later_ties -= tl.sum(is_tie, axis=0)
                if part == 0:
                    filled = total_above + tl.minimum(ties_wanted, total_equal)
                    for fill_start in range(0, topk, FILL):
                        i = fill_start + tl.arange(0, FILL)
                        tl.store(row_out + i, tl.full([FILL], -1, tl.int32), mask=(i >= filled) & (i < topk))


def split_row(num_seqs: int, width: int, span: int | None = None, block: int = BLOCK) -> tuple[int, int]:
    """(parts, span): a row's programs and the positions each covers (a multiple of `block`)."""
    if span is None:
        want_parts = -(-TARGET_PROGRAMS // max(num_seqs, 1))
        if L2_ROW_BYTES and num_seqs * width * 4 > L2_ROW_BYTES:
            want_parts = max(want_parts, -(-RESIDENT_PROGRAMS * width * 4 // L2_ROW_BYTES))
        want_parts = max(1, min(MAX_PARTS, want_parts))
        span = block * max(1, -(-width // (want_parts * block)))
    if span <= 0 or span % block:
        raise ValueError(f"span {span} must be a positive multiple of {block}")
    parts = -(-width // span)
    if parts > MAX_PARTS:
        raise ValueError(f"span {span} splits a {width}-position row into {parts} parts; at most {MAX_PARTS}")
    return parts, span


def one_launch_ok(device: torch.device) -> bool:
    """The barrier form needs every program of a row running at once: a real GPU, not the
    interpreter."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def select_rows(scores: torch.Tensor, g_lens: torch.Tensor, out: torch.Tensor, k: int,
                phased: bool | None = None, span: int | None = None, block: int = BLOCK,
                sparse_from: int | None = None, ws: torch.Tensor | None = None, sparse_max: int | None = None,
                num_warps: int = 4, only_phase: int | None = None, record: bool | None = None) -> torch.Tensor:
    """Write into out [B, topk] int32 the positions of each row's k highest scores (equal
    scores: latest position first; positions >= g_len never), -1 after them. scores [B, width]
    fp32, never read at or past g_len (any content there); g_lens int32 on the scores' device;
    1 <= k <= width.
    `phased` runs each phase as its own launch (the default off a GPU); `span` (a multiple of
    `block`, the positions a program loads a step) overrides the positions a program covers
    (bench.probe_select times the choices). `sparse_from`: the first byte pass that counts
    blocks with few matching keys by atomics instead of a histogram (4: none; default
    SPARSE_FROM, MANY_SPARSE_FROM from MANY_ROWS rows), `sparse_max` the most keys a block counts
    so (SPARSE_MAX, MANY_SPARSE_MAX). `ws`: int32 [B, WORKSPACE_COLS], zeroed
    (the scoring launch can clear it, which spares a launch); None allocates one. `record`:
    the count phase from the last pass's kept positions (default RECORD). For
    bench.probe_select: `num_warps`, and `only_phase`, that phase's launch of the phased form
    alone over a `ws` that holds the earlier phases' results."""
    num_seqs, width = scores.shape
    topk = out.shape[1]
    parts, span = split_row(num_seqs, width, span, block)
    if phased is None:
        phased = not one_launch_ok(scores.device)
    if ws is None:
        ws = torch.zeros(num_seqs, WORKSPACE_COLS, device=scores.device, dtype=torch.int32)
    elif ws.shape != (num_seqs, WORKSPACE_COLS) or ws.dtype != torch.int32 or not ws.is_contiguous():
        raise ValueError(f"ws must be a contiguous int32 [{num_seqs}, {WORKSPACE_COLS}]")
    fill = min(1024, max(16, triton.next_power_of_2(topk)))
    many = num_seqs >= MANY_ROWS
    if sparse_from is None:
        sparse_from = MANY_SPARSE_FROM if many else SPARSE_FROM
    if sparse_max is None:
        sparse_max = MANY_SPARSE_MAX if many else SPARSE_MAX
    phases = [(p, p) for p in range(_PHASES)] if phased else [(0, _PHASES - 1)]
    if only_phase is not None:
        phases = [(only_phase, only_phase)]
    for first, last in phases:
        _select_kernel[(num_seqs * parts,)](
            scores, g_lens, out, ws, scores.stride(0), out.stride(0), ws.stride(0),
            width, num_seqs, parts, span, k, topk,
            FIRST=first, LAST=last, BLOCK=block, PARTS=MAX_PARTS, FILL=fill,
            SPARSE_FROM=sparse_from, SPARSE_MAX=sparse_max, RECORD=RECORD if record is None else record,
            REC=RECORDS, num_warps=num_warps, **pdl_launch(scores))
    return out
