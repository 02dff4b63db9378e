"""The top-p (nucleus) cut of each row of logits, without sorting the row.

A row keeps its largest logits until the probability mass of those before the next one reaches
top_p. Sorting 64 rows of a 129K vocabulary to find that cut costs 1.4 ms of an 8 ms decode step
(bench.sampling on the H200). Here the cut is found as a threshold over the order keys of the
row's floats (uint32, ordered as the floats are): the smallest key whose mass above stays under
top_p times the row's total. Each pass splits every row's key interval into 16 and adds up the
mass above each split point, the row spread over many programs; 8 passes close an interval of
2^32 keys to one, so the threshold is a logit of the row, exact at fp32, as the sort's is.

A first pass finds each chunk's largest logit and its softmax sum; every later program derives
the row's maximum and total from those, and its interval from the pass before (the state its
first program stored and the partial masses of every chunk), so the passes need no launch between
them. The chunks' masses are added in one order by every program: seeded rows sample the same.

`nucleus_threshold_reference` defines the semantics (a sort, a softmax and a cumulative sum);
`nucleus_threshold_triton` matches it up to the order in which the masses are added (a logit whose
mass-before lies within rounding of top_p may fall on the other side). Over a wide row the sort's
running fp32 sum is the less exact of the two: at 129,280 tokens it kept up to 13 tokens more or
fewer than sums in fp64, where the kernel's cut was fp64's (tests/test_kernel_nucleus.py).
`nucleus_threshold` picks one.
"""
from __future__ import annotations

import torch

from . import kernel_or_reference, triton_ok

try:
    import triton
    import triton.language as tl
except Exception:  # the reference path must keep working where triton is absent
    triton = None

_BLOCK = 4096
_SUB = 512  # a mass program's logits per step: [SPLITS, SUB] sums in registers
_PROGRAMS_WANTED = 128  # mass programs in all (about one an SM) where the rows allow
_MOST_CHUNKS_PER_PROGRAM = 8
_SPLITS = 16
_PASSES = 8  # 16**8 = 2**32: an interval of every uint32 key closes to one


def nucleus_threshold_reference(logits: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """For each row of `logits` [rows, vocab]: the smallest logit it keeps under its top_p [rows]
    among the logits at or above its floor [rows] (a top-k cut, or -inf), the mass normalised over
    those. fp32 [rows]. A row keeps at least its largest logit."""
    x = logits.float().masked_fill(logits < floor[:, None], float("-inf"))
    ordered = x.sort(-1, descending=True).values
    probs = ordered.softmax(-1)
    kept = ((probs.cumsum(-1) - probs) < top_p[:, None]).sum(-1, keepdim=True).clamp(min=1)
    return ordered.gather(1, kept - 1).squeeze(1)


if triton is not None:
    from .row_select import _key_to_score, _order_key

    # row_ptr: each row's floor, then each row's top_p ([2 * rows] fp32, one fresh buffer: views of
    # the caller's would be 16-byte aligned or not by batch size, and each case a build of its own)
    @triton.jit
    def _chunk_logits(x_ptr, row_ptr, row, chunk, vocab, stride, BLOCK: tl.constexpr):
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        return tl.where(x >= tl.load(row_ptr + row), x, float("-inf"))

    @triton.jit(do_not_specialize=["vocab", "stride"])
    def _stats_kernel(x_ptr, row_ptr, stats_ptr, vocab, stride, BLOCK: tl.constexpr):
        """Each chunk's largest logit and the sum of exp(logit - it) over the chunk."""
        row, chunk, chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        x = _chunk_logits(x_ptr, row_ptr, row, chunk, vocab, stride, BLOCK)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)
        tl.store(stats_ptr + (row * chunks + chunk) * 2, m)
        tl.store(stats_ptr + (row * chunks + chunk) * 2 + 1, s)

    @triton.jit
    def _row_state(stats_ptr, row_ptr, part_ptr, state_ptr, row, rows, chunks, progs, PASS: tl.constexpr,
                   CHUNKS: tl.constexpr, SPLITS: tl.constexpr):
        """(the row's largest logit, the mass top_p asks for, and the key interval (lo, hi] that
        holds the threshold) before pass PASS: the same in every program of the row."""
        c = tl.arange(0, CHUNKS)
        m_c = tl.load(stats_ptr + (row * chunks + c) * 2, mask=c < chunks, other=float("-inf"))
        s_c = tl.load(stats_ptr + (row * chunks + c) * 2 + 1, mask=c < chunks, other=0.0)
        m = tl.max(m_c, axis=0)
        total = tl.sum(tl.where(m_c > float("-inf"), s_c * tl.exp(m_c - m), 0.0), axis=0)
        target = tl.load(row_ptr + rows + row) * total
        # Invariant: the mass above key lo reaches the target (key 0 lies below every float's),
        # the mass above hi does not (nothing lies above the maximum).
        if PASS == 0:
            lo = tl.zeros([], dtype=tl.int64)
            hi = _order_key(m).to(tl.int64)
        else:
            lo = tl.load(state_ptr + ((PASS - 1) * rows + row) * 2)
            hi = tl.load(state_ptr + ((PASS - 1) * rows + row) * 2 + 1)
            k = tl.arange(0, SPLITS)
            above = tl.sum(tl.load(part_ptr + (((PASS - 1) * rows + row) * progs + c[:, None]) * SPLITS + k[None, :],
                                   mask=(c[:, None] < progs) & (k[None, :] > 0), other=0.0), axis=0)
            split = lo + ((hi - lo) * k) // SPLITS
            under = (above < target) & (k > 0)
            new_hi = tl.min(tl.where(under, split, hi), axis=0)
            lo = tl.max(tl.where(~under & (k > 0), split, lo), axis=0)
            hi = new_hi
        return m, target, lo, hi

    @triton.jit(do_not_specialize=["vocab", "stride", "rows", "chunks", "per_prog"])
    def _mass_kernel(x_ptr, row_ptr, stats_ptr, part_ptr, state_ptr, vocab, stride, rows, chunks, per_prog,
                     PASS: tl.constexpr, CHUNKS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                     SUB: tl.constexpr):
        """Pass PASS: the mass above each split point of the row's interval in the program's
        `per_prog` chunks."""
        row, prog, progs = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        m, target, lo, hi = _row_state(stats_ptr, row_ptr, part_ptr, state_ptr, row, rows, chunks, progs,
                                       PASS, CHUNKS, SPLITS)
        if prog == 0:  # for the next pass's programs
            tl.store(state_ptr + (PASS * rows + row) * 2, lo)
            tl.store(state_ptr + (PASS * rows + row) * 2 + 1, hi)
        k = tl.arange(0, SPLITS)
        # every split lies in [lo, hi], within the uint32 keys: compared in 32 bits
        split = (lo + ((hi - lo) * k) // SPLITS).to(tl.uint32)
        # the masses above every split point summed side by side, reduced once at the end: a
        # block-wide sum per split point (15 barriers a chunk) cost more than the adds
        acc = tl.zeros([SPLITS, SUB], dtype=tl.float32)
        for i in range(per_prog):
            for sub in tl.static_range(BLOCK // SUB):
                part = ((prog * per_prog + i) * BLOCK) // SUB + sub  # past the row's end: masked
                x = _chunk_logits(x_ptr, row_ptr, row, part, vocab, stride, SUB)
                w = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
                acc += tl.where(_order_key(x)[None, :] > split[:, None], w[None, :], 0.0)
        out = part_ptr + ((PASS * rows + row) * progs + prog) * SPLITS
        tl.store(out + k, tl.sum(acc, axis=1), mask=k > 0)

    @triton.jit(do_not_specialize=["rows", "chunks", "progs"])
    def _threshold_kernel(stats_ptr, row_ptr, part_ptr, state_ptr, out_ptr, rows, chunks, progs,
                          PASS: tl.constexpr, CHUNKS: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        _, _, _, hi = _row_state(stats_ptr, row_ptr, part_ptr, state_ptr, row, rows, chunks, progs,
                                 PASS, CHUNKS, SPLITS)
        # every logit with a key from hi up is kept, every one at lo or under is not
        tl.store(out_ptr + row, _key_to_score(hi.to(tl.uint32)))


def chunks_per_program(rows: int, chunks: int) -> int:
    """How many of a row's chunks one mass program adds up. Each program first rebuilds its row's
    state from every program's masses of the pass before, so past a few programs an SM, longer
    programs win. On an H100 at 129,280 tokens (32 chunks a row; bench/RESULTS.md, fortieth
    session), us a call by chunks a program 1 / 2 / 4 / 8: batch 1 39 / 54 / 79 / 130, batch 8
    58 / 57 / 81 / 132, batch 16 102 / 86 / 83 / 134, batch 32 186 / 152 / 138 / 137, batch 64
    363 / 295 / 267 / 251, batch 256 1410 / 1152 / 1007 / 959."""
    return max(1, min(chunks, _MOST_CHUNKS_PER_PROGRAM, chunks * rows // _PROGRAMS_WANTED))


def nucleus_threshold_triton(logits: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("triton is not available")
    if logits.dim() != 2 or floor.shape != logits.shape[:1] or top_p.shape != logits.shape[:1]:
        raise ValueError(f"logits [rows, vocab] with floor and top_p [rows], got {tuple(logits.shape)}, "
                         f"{tuple(floor.shape)}, {tuple(top_p.shape)}")
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if not rows:
        return out
    chunks = triton.cdiv(vocab, _BLOCK)
    per_prog = chunks_per_program(rows, chunks)
    progs = triton.cdiv(chunks, per_prog)
    row_params = torch.cat([floor.float(), top_p.float()])
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=x.device)
    part = torch.empty(_PASSES, rows, progs, _SPLITS, dtype=torch.float32, device=x.device)
    state = torch.empty(_PASSES, rows, 2, dtype=torch.int64, device=x.device)
    # CHUNKS bounds the programs of a row too (one build for every batch size)
    consts = dict(CHUNKS=triton.next_power_of_2(chunks), SPLITS=_SPLITS)
    _stats_kernel[(rows, chunks)](x, row_params, stats, vocab, x.stride(0), BLOCK=_BLOCK, num_warps=8)
    for p in range(_PASSES):
        _mass_kernel[(rows, progs)](x, row_params, stats, part, state, vocab, x.stride(0), rows, chunks, per_prog,
                                    PASS=p, BLOCK=_BLOCK, SUB=_SUB, num_warps=8, **consts)
    _threshold_kernel[(rows,)](stats, row_params, part, state, out, rows, chunks, progs, PASS=_PASSES, **consts)
    return out


def nucleus_threshold(logits: torch.Tensor, floor: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The kernel where it runs (a GPU), else the reference."""
    if triton_ok(logits):
        return kernel_or_reference("nucleus_threshold", nucleus_threshold_triton, nucleus_threshold_reference,
                                   logits, floor, top_p)
    return nucleus_threshold_reference(logits, floor, top_p)
