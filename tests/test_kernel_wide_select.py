"""wideep_kernels/wide_select.py: each row's k-th largest score from the candidates above a bound from
strided group maxima, or from the whole row where they overflow; against torch.topk's k-th
score and the reference selection, exactly."""
import pytest
import torch

from kernel_devices import DEVICES, poison_empty
import wideep_kernels.wide_select as ws
from wideep_kernels.indexer import kth_scores, select_topk_reference, select_topk_triton, warm_up

NEG_INF = float("-inf")


def kth_reference(scores, k):
    return kth_scores(scores, k, method="topk")


def as_sets(pos):
    return [sorted(p for p in row.tolist() if p >= 0) for row in pos.cpu()]


def check_select(scores, g_lens, topk):
    """select_topk_triton(method="threshold") picks the reference's positions. The reference
    reads clean scores (-inf past g_len); the kernel gets a copy with +inf and NaN there, which
    it must never use."""
    want = select_topk_reference(scores, g_lens, topk)
    dirty = scores.clone()
    dead = torch.arange(scores.shape[1], device=scores.device)[None, :] >= g_lens[:, None].long()
    garbage = torch.where(torch.arange(scores.shape[1], device=scores.device) % 2 == 0, float("inf"), float("nan"))
    dirty[dead] = garbage.expand_as(dirty)[dead]
    got = select_topk_triton(dirty, g_lens, topk, method="threshold")
    assert got.shape == want.shape and got.dtype == torch.int32
    assert as_sets(got) == as_sets(want)
    for row, n in zip(got.cpu(), g_lens.tolist()):
        assert int((row == -1).sum()) == topk - min(n, topk) and not (row < -1).any()


def with_garbage_beyond(scores):
    """The same scores as a view into wider rows whose columns past the width hold NaN and +inf:
    nothing may read past the row's width."""
    num_seqs, width = scores.shape
    wide = torch.full((num_seqs, width + 80), float("nan"), device=scores.device)
    wide[:, width + 40:] = float("inf")
    wide[:, :width] = scores
    return wide[:, :width]


def mask_dead(scores, g_lens):
    dead = torch.arange(scores.shape[1])[None, :] >= g_lens[:, None].long()
    return scores.masked_fill(dead, NEG_INF)


def random_rows(width, seed):
    """Rows of differing kinds: normal, all negative, 70% exact zeros (and -0.0) with the rest
    either side, a handful of values repeated everywhere, a trend towards later positions, and
    70% zeros with the rest negative but for 8 (the k-th score is a zero: the bound is 0 and
    every zero a candidate)."""
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(width, generator=g)
    negative = -torch.rand(width, generator=g) - 0.5
    zeros = torch.randn(width, generator=g)
    zeros[torch.rand(width, generator=g) < 0.7] = 0.0
    zeros[::5] = -0.0
    repeats = torch.randint(-3, 4, (width,), generator=g).float() / 4
    trend = torch.randn(width, generator=g) * 0.3 + torch.linspace(0, 4, width)
    zero_kth = zeros.clone()
    zero_kth[zero_kth > 0] *= -1
    zero_kth[torch.randperm(width, generator=g)[:8]] = 1.0
    return torch.stack([normal, negative, zeros, repeats, trend, zero_kth])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,k", [(3000, 40), (4096, 16), (2500, 64), (700, 64)])
def test_kth_matches_topk(device, width, k, monkeypatch):
    poison_empty(monkeypatch)
    scores = random_rows(width, seed=width + k).to(device)
    want = kth_reference(scores, k)
    got = kth_scores(with_garbage_beyond(scores), k, method="threshold")
    assert torch.equal(got, want) and got[5] == 0.0, (got, want)
    # the bound did its job: the k highest are found among few candidates, not the whole row
    _, _, count = ws.threshold_passes(scores, k)
    assert (count[:2] >= k).all() and (count[:2] < width // 4).all(), count


@pytest.mark.parametrize("device", DEVICES)
def test_kth_with_minus_inf_padding_and_short_rows(device, monkeypatch):
    """Rows that end early (-inf after), shorter than k, empty: the k-th largest counts the
    -inf padding, as torch.topk does. The short and empty rows keep to their few candidates."""
    poison_empty(monkeypatch)
    width, k = 3000, 48
    g_lens = torch.tensor([width, 2000, 130, k, k - 1, 5, 0])
    scores = mask_dead(torch.randn(len(g_lens), width, generator=torch.Generator().manual_seed(3)), g_lens).to(device)
    got = kth_scores(with_garbage_beyond(scores), k, method="threshold")
    want = kth_reference(scores, k)
    assert torch.equal(got, want), (got, want)
    assert torch.isinf(got[4:]).all() and torch.isfinite(got[:4]).all()
    _, _, count = ws.threshold_passes(scores, k)
    assert count.tolist()[4:] == [k - 1, 5, 0]  # no row overflowed: the -inf places were counted


@pytest.mark.parametrize("device", DEVICES)
def test_overflowing_rows_take_the_whole_row(device, monkeypatch):
    """Row 0 has its 32 highest scores in one group (positions j + i * T) and ties at the bound
    everywhere else: every position is a candidate, far past the capacity, and the first
    candidates alone would give 1.0. Row 1 in the same launch fits. Both are exact."""
    poison_empty(monkeypatch)
    width, k, capacity = 4096, 32, 200
    stride = ws.group_stride(width, k)
    assert width // stride >= 16
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(3, width, generator=g)
    scores[0] = 1.0
    scores[0, 7::stride] = 2.0 + torch.rand(len(range(7, width, stride)), generator=g)
    scores[2] = 0.0  # every score ties at the k-th
    scores[2, -3:] = 1.0
    scores = scores.to(device)
    _, _, count = ws.threshold_passes(scores, k, capacity=capacity)
    assert count[0] == width and count[2] == width and count[1] <= capacity
    monkeypatch.setattr(ws, "CAPACITY", capacity)
    got = kth_scores(scores, k, method="threshold")
    want = kth_reference(scores, k)
    assert torch.equal(got, want) and got[0] > 2.0 and got[2] == 0.0, (got, want)
    g_lens = torch.tensor([width, width - 9, width - 2], dtype=torch.int32, device=device)
    check_select(mask_dead(scores.cpu(), g_lens.cpu()).to(device), g_lens, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs,block", [(8, 256), (4096, 256)])
def test_several_blocks_and_programs_a_row(device, programs, block, monkeypatch):
    """Candidates appended by several programs (one atomic a block), passes whose programs each
    loop over several blocks or hold one block each, in the row and the candidates, group maxima
    over several steps of members."""
    monkeypatch.setattr(ws, "GROUP_ROWS", 4)
    monkeypatch.setattr(ws, "CANDIDATE_PROGRAMS", programs)
    monkeypatch.setattr(ws, "PASS_PROGRAMS", programs)
    monkeypatch.setattr(ws, "BLOCK", block)
    monkeypatch.setattr(ws, "CANDIDATE_BLOCK", block)
    monkeypatch.setattr(ws, "CAPACITY", 600)
    poison_empty(monkeypatch)
    width, k = 4000, 64
    scores = random_rows(width, seed=11)
    scores[4] = (torch.rand(width, generator=torch.Generator().manual_seed(12)) < 0.9).float()  # ties at 1.0
    scores = scores.to(device)
    _, _, count = ws.threshold_passes(scores, k)
    assert count[4] > 600 and (count[:2] < 2 * k).all()  # every member counted in its group's maximum
    assert torch.equal(kth_scores(scores, k, method="threshold"), kth_reference(scores, k))
    g_lens = torch.tensor([width, 3001, 1024, 63, width, 3999], dtype=torch.int32)
    check_select(mask_dead(scores.cpu(), g_lens).to(device), g_lens.to(device), k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,topk", [(3000, 40), (2048, 64), (1000, 1000), (640, 700)])
def test_select_matches_reference(device, width, topk, monkeypatch):
    """Positions: everything above the k-th score, the latest of those equal to it; rows shorter
    than topk and empty rows fill with -1; nothing at or past g_len is read."""
    poison_empty(monkeypatch)
    scores = random_rows(width, seed=width)
    g_lens = torch.tensor([width, width - 3, width // 2, min(topk, width) - 1, 0, width - 1], dtype=torch.int32)
    check_select(mask_dead(scores, g_lens).to(device), g_lens.to(device), topk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fitted_programs", [1024, 6])
def test_select_from_candidates_and_from_overflowing_rows(device, fitted_programs, monkeypatch):
    """Rows whose candidates fit take their positions from the candidates (emit_candidates),
    including rows with more ties at the k-th score than places; rows that overflow a small
    capacity take the passes over the whole row; both in one batch. With 6 programs for the
    whole-row passes (wideep_kernels/indexer.py FITTED_PROGRAMS) each takes all three chunks of its row."""
    import wideep_kernels.indexer
    monkeypatch.setattr(wideep_kernels.indexer, "FITTED_PROGRAMS", fitted_programs)
    monkeypatch.setattr(ws, "CAPACITY", 64)
    poison_empty(monkeypatch)
    width, topk = 2500, 24
    scores = random_rows(width, seed=5)  # the tied rows overflow 64 places, the normal ones fit
    scores[3] = torch.randn(width, generator=torch.Generator().manual_seed(6))
    scores[3, ::7] = 2.5  # 358 ties above the rest: they fit only in the default capacity
    g_lens = torch.tensor([width, width - 9, 1800, width, width, 700], dtype=torch.int32)
    scores = mask_dead(scores, g_lens)
    count = ws.threshold_passes(scores.to(device), topk, g_lens.to(device))[2].cpu()
    assert (count <= 64).any() and (count > 64).any()
    check_select(scores.to(device), g_lens.to(device), topk)
    monkeypatch.setattr(ws, "CAPACITY", 16384)
    count = ws.threshold_passes(scores.to(device), topk, g_lens.to(device))[2].cpu()
    assert int(count[3]) >= 358 and (count <= 16384).all()
    check_select(scores.to(device), g_lens.to(device), topk)


def test_candidate_buffers_must_match():
    with pytest.raises(ValueError, match="candidates must be"):
        ws.threshold_passes(torch.zeros(2, 64), 4, candidates=ws.candidate_buffers(1, "cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    scores = torch.empty(0, 512, device=device)
    assert kth_scores(scores, 16, method="threshold").shape == (0,)
    hist, state, count = ws.threshold_passes(scores, 16)
    assert hist.shape == (4, 0, 256) and count.shape == (0,)
    out = select_topk_triton(scores, torch.empty(0, dtype=torch.int32, device=device), 16, method="threshold")
    assert out.shape == (0, 16)


def test_group_stride(monkeypatch):
    """At least GROUPS_PER_K k groups (or the whole row), a multiple of the tile, never fewer
    than k: the k-th group maximum exists."""
    for width in (1, 63, 64, 700, 4096, 65536, 524288, 1 << 20):
        for k in (1, 16, 2048):
            if k > width:
                continue
            t = ws.group_stride(width, k)
            assert t % ws.GROUP_TILE == 0 and t >= k
            assert t >= min(ws.GROUPS_PER_K * k, width)
            assert t < max(ws.GROUPS_PER_K * k, width) + ws.GROUP_TILE
    for groups in (2, 4):
        monkeypatch.setattr(ws, "GROUPS_PER_K", groups)
        assert ws.group_stride(524288, 2048) == groups * 2048


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="k must be"):
        ws.threshold_passes(torch.zeros(2, 64), 65)
    with pytest.raises(ValueError, match="contiguous"):
        ws.threshold_passes(torch.zeros(64, 2).t(), 4)


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_builds_the_threshold_select(device, monkeypatch):
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    calls = []
    real = ws.threshold_passes
    monkeypatch.setattr(ws, "threshold_passes", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    warm_up(16, device, max_rows=2)
    assert calls and all(shape[1] >= 16 for shape in calls)


@pytest.mark.parametrize("device", DEVICES)
def test_atomic_counting_leaves_the_histograms_exact(device, monkeypatch):
    """The candidates' passes counting blocks with few matching keys by atomics, from the second
    or the third byte: the same histograms, bin for bin, as histograms alone (the emit reads the
    k-th key's bin as its count of ties). Several programs a row, each bounded by the row's last
    candidate; one row overflows its places and takes the passes over all of it."""
    monkeypatch.setattr(ws, "CANDIDATE_PROGRAMS", 24)
    monkeypatch.setattr(ws, "PASS_PROGRAMS", 24)
    monkeypatch.setattr(ws, "BLOCK", 256)
    monkeypatch.setattr(ws, "CANDIDATE_BLOCK", 256)
    monkeypatch.setattr(ws, "CAPACITY", 1024)
    width, k = 4000, 64
    scores = random_rows(width, seed=21)
    scores[3] = (torch.rand(width, generator=torch.Generator().manual_seed(22)) < 0.5).float()  # overflows
    scores = scores.to(device)
    runs = []
    for sparse_from, sparse_max in [(4, 64), (2, 64), (1, 256), (1, 4096)]:
        monkeypatch.setattr(ws, "PASS_SPARSE_FROM", sparse_from)
        monkeypatch.setattr(ws, "PASS_SPARSE_MAX", sparse_max)
        runs.append(ws.threshold_passes(scores, k))
    assert runs[0][2][3] > 1024 and (runs[0][2][:3] <= 1024).all()
    for hist, state, count in runs[1:]:
        assert torch.equal(hist, runs[0][0]) and torch.equal(state, runs[0][1]) and torch.equal(count, runs[0][2])
    assert torch.equal(kth_scores(scores, k, method="threshold"), kth_reference(scores, k))
