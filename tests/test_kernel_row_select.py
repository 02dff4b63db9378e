import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from wideep_kernels.indexer import select_topk_reference  # noqa: E402
from wideep_kernels import row_select  # noqa: E402
from wideep_kernels.row_select import (BLOCK, L2_ROW_BYTES, MAX_PARTS, RESIDENT_PROGRAMS, SPARSE_MAX_ROWS,  # noqa: E402
                                       select_rows, split_row)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def same_sets(got, want):
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


def tied_rows(width, seed, device):
    """Scores from few values (the k-th shared across parts), a row of zeros, -0.0 against
    +0.0, short and empty rows (-inf past g_len), and distinct ones (where few keys still match
    after two bytes: the atomics path)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (6, width), generator=g).float() / 8
    scores[1] = 0.0
    scores[2, ::3] = -0.0
    scores[3] = 1.0 + torch.randint(0, 64, (width,), generator=g).float() / 4096  # one binade
    scores[5] = torch.randn(width, generator=g)
    g_lens = torch.tensor([width, width - 5, width // 2, width - 1, 0, width - 3], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    return scores.to(device), g_lens.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,topk,span", [(1500, 100, 512), (1500, 700, 512), (1500, 1500, 1024),
                                             (700, 900, None), (2100, 5, 512)])
@pytest.mark.parametrize("sparse_from", [2, 0, 4])
def test_phases_match_reference(device, width, topk, span, sparse_from):
    """Each phase as its own launch (the form the interpreter runs): every part of a row adds its
    histogram, counts and emits at the right offsets, ties across parts latest first; blocks
    with few matching keys counted by atomics from the third byte (the default), from the first,
    or never."""
    scores, g_lens = tied_rows(width, width + topk, device)
    out = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=device)
    select_rows(scores, g_lens, out, min(topk, width), phased=True, span=span, sparse_from=sparse_from)
    same_sets(out, select_topk_reference(scores, g_lens, topk))


@pytest.mark.parametrize("device", DEVICES)
def test_count_from_the_last_pass_positions(device):
    """The count phase from the few positions the last byte pass kept (distinct scores), or from
    its span again where they did not fit (ties) or the k-th is NaN: the same places as without
    them, the reference's positions."""
    scores, g_lens = tied_rows(1500, 11, device)
    extra = torch.randn(2, 1500, device=device)
    extra[1, :40] = float("nan")  # NaN scores order above +inf: the k-th (k = 30) is one
    scores = torch.cat([scores, extra])
    g_lens = torch.cat([g_lens, torch.tensor([1500, 1500], dtype=torch.int32, device=device)])
    for topk in (30, 400):
        kept = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=device)
        plain = torch.empty_like(kept)
        for record, out in ((True, kept), (False, plain)):
            select_rows(scores, g_lens, out, topk, phased=True, span=512, record=record)
        assert torch.equal(kept, plain)
        same_sets(kept[:-1], select_topk_reference(scores[:-1], g_lens[:-1], topk))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk", [100, 1400, 1600])
def test_positions_past_the_length_are_never_read(device, topk):
    """A row's positions past g_len count as -inf without a load: garbage there (large scores,
    NaN) changes nothing. topk 1400 takes the passes in the longer rows and every position of
    the shorter; 1600 is more than every row holds, so each takes every live position unread."""
    scores, g_lens = tied_rows(1500, 3, device)
    want = select_topk_reference(scores, g_lens, topk)
    dead = torch.arange(1500, device=device)[None, :] >= g_lens[:, None].long()
    scores[dead] = 1e30
    scores[2, -1] = float("nan")
    for phased in (True, False) if device == "cuda" else (True,):
        out = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=device)
        select_rows(scores, g_lens, out, min(topk, 1500), phased=phased, span=512)
        same_sets(out, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,many", [(SPARSE_MAX_ROWS + 1, False), (12, True)])
def test_default_counting_at_many_rows(device, rows, many, monkeypatch):
    """At any number of rows the last byte passes count by atomics where few keys match (the
    radix passes' limit, SPARSE_MAX_ROWS, is not this kernel's), and from MANY_ROWS rows the
    second too, up to MANY_SPARSE_MAX keys a block (here from 12 rows, to keep the interpreter's
    run short): the reference's positions."""
    if many:
        monkeypatch.setattr(row_select, "MANY_ROWS", rows)
    seen, kernel = set(), row_select._select_kernel

    class Spy:  # the counting options each launch was given
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.add((kwargs["SPARSE_FROM"], kwargs["SPARSE_MAX"]))
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(row_select, "_select_kernel", Spy())
    width = 1100
    g = torch.Generator().manual_seed(rows)
    scores = torch.randn(rows, width, generator=g)
    g_lens = torch.randint(width // 2, width + 1, (rows,), generator=g).to(torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    scores, g_lens = scores.to(device), g_lens.to(device)
    out = torch.empty(rows, 300, dtype=torch.int32, device=device)
    select_rows(scores, g_lens, out, 300)
    same_sets(out, select_topk_reference(scores, g_lens, 300))
    want = (row_select.MANY_SPARSE_FROM, row_select.MANY_SPARSE_MAX) if many else (row_select.SPARSE_FROM,
                                                                                 row_select.SPARSE_MAX)
    assert seen == {want}


@pytest.mark.parametrize("device,phased", [
    pytest.param("cpu", True, marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", True, marks=CUDA), pytest.param("cuda", False, marks=CUDA)])
def test_rows_no_longer_than_k_take_every_position(device, phased):
    """Rows of at most k live positions among longer ones: each gets all of its positions, then
    -1, without its scores being read (NaN there changes nothing); the longer rows get the
    reference's choice. The one launch (phased False) needs a GPU."""
    width, topk = 2500, 700
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(6, width, generator=g)
    g_lens = torch.tensor([0, 1, 699, 700, 701, width], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    want = select_topk_reference(scores, g_lens, topk)
    scores[:4] = float("nan")  # rows of at most k positions: never read
    scores, g_lens = scores.to(device), g_lens.to(device)
    out = torch.full((6, topk), 12345, dtype=torch.int32, device=device)
    select_rows(scores, g_lens, out, topk, phased=phased, span=512)
    same_sets(out, want.to(device))
    for row, n in enumerate((0, 1, 699, 700)):
        got = out[row].sort().values.cpu()
        assert torch.equal(got[topk - n:], torch.arange(n, dtype=torch.int32)) and bool((got[:topk - n] == -1).all())


def test_split_row_fills_the_gpu_and_keeps_parts_bounded():
    parts, span = split_row(1, 32768)
    assert span % BLOCK == 0 and parts * span >= 32768 and parts > 1
    parts64, span64 = split_row(64, 32768)
    assert parts64 < parts and parts64 * span64 >= 32768  # more rows, fewer parts each
    parts, span = split_row(16, 1 << 20)
    assert parts <= MAX_PARTS and parts * span >= 1 << 20
    # Many wide rows (a prompt chunk): split so that the rows worked on at once fit the L2 budget.
    parts, span = split_row(1024, 32768)
    assert parts * span >= 32768 and (RESIDENT_PROGRAMS // parts) * 32768 * 4 <= L2_ROW_BYTES
    assert split_row(1024, 131072)[0] > parts
    with pytest.raises(ValueError, match="multiple"):
        split_row(1, 4096, span=300)
    with pytest.raises(ValueError, match="at most"):
        split_row(1, BLOCK * (MAX_PARTS + 1), span=BLOCK)


@CUDA
@pytest.mark.parametrize("width,topk,batch", [(8192, 2048, 1), (8192 + 64, 2048, 64), (131072, 2048, 16),
                                              (3000, 4000, 3)])
def test_one_launch_matches_phases_and_reference(width, topk, batch):
    """The barrier form (one launch) against the phased one and the reference, on random rows
    with -inf tails, and in a CUDA graph replayed twice with new scores."""
    g = torch.Generator(device="cuda").manual_seed(width)
    scores = torch.randn(batch, width, device="cuda", generator=g)
    g_lens = torch.randint(width // 2, width + 1, (batch,), device="cuda", generator=g).to(torch.int32)
    scores[torch.arange(width, device="cuda")[None, :] >= g_lens[:, None].long()] = float("-inf")
    k = min(topk, width)
    one = select_rows(scores, g_lens, torch.empty(batch, topk, dtype=torch.int32, device="cuda"), k, phased=False)
    phased = select_rows(scores, g_lens, torch.empty(batch, topk, dtype=torch.int32, device="cuda"), k, phased=True)
    want = select_topk_reference(scores, g_lens, topk)
    same_sets(one, want)
    assert torch.equal(one, phased)  # same positions in the same places: the emit is deterministic

    out = torch.empty(batch, topk, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    select_rows(scores, g_lens, out, k)  # build before capture
    with torch.cuda.graph(graph):
        select_rows(scores, g_lens, out, k)
    for _ in range(2):
        scores.copy_(torch.randn(batch, width, device="cuda", generator=g))
        scores[torch.arange(width, device="cuda")[None, :] >= g_lens[:, None].long()] = float("-inf")
        graph.replay()
        same_sets(out, select_topk_reference(scores, g_lens, topk))


def test_one_launch_can_be_turned_off_by_environment():
    """WIDEEP_ONE_LAUNCH_SELECT=0: rows of every width take the multi-launch radix passes (or, for
    batches of 2M positions and more, the threshold select) instead of the barrier kernel."""
    code = ("import wideep_kernels.indexer as m; "
            "print(m.default_select(8192, 16), m.default_select(32768, 16), m.default_select(1 << 20), "
            "m.default_select(1 << 17, 16), m.default_select(1 << 16, 16))")
    for value, want in (("0", "radix radix radix threshold radix"), ("1", "fused fused radix threshold radix")):
        env = dict(os.environ, WIDEEP_ONE_LAUNCH_SELECT=value)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split() == want.split()


def test_a_prompt_chunks_many_rows_take_the_threshold_select(monkeypatch):
    """Rows narrow enough for the one launch go to the threshold select once they hold
    FUSED_MAX_POSITIONS positions in all (a prompt chunk's 1,024 rows from 24K); decode batches
    of FUSED_MIN_ROWS rows or more keep the one launch, smaller ones take the radix passes."""
    import wideep_kernels.indexer as m
    assert m.default_select(24576, 1024) == "threshold"
    assert m.default_select(32768, 1024) == "threshold"
    assert m.default_select(16384, 1024) == "fused"
    assert m.default_select(32768, 256) == "fused"
    assert m.default_select(8192, m.FUSED_MIN_ROWS) == "fused"
    assert m.default_select(8192, m.FUSED_MIN_ROWS - 1) == "radix"  # few rows: the radix passes
    assert m.default_select(65536, 1024) == "threshold"
    monkeypatch.setattr(m, "FUSED_MAX_POSITIONS", 1 << 62)
    assert m.default_select(32768, 1024) == "fused"
