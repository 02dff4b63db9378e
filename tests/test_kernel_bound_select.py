"""kernels/bound_select.py: the top-k of wide rows from the candidates above a bound kept from the
last step. Exact against the reference whatever the bound: a bound above the k-th score (too few
candidates) or far below it (more than the capacity) sends the row to the passes over its whole
row, counted as a miss; a bound from a similar step keeps the row on its candidates."""
import pytest
import torch

from kernel_devices import DEVICES, poison_empty
import kernels.index_score as score
import kernels.indexer as indexer
import kernels.wide_select as ws
from kernels.bound_select import bound_misses, bound_state, bound_workspace, check_bounds
from test_kernel_indexer import check_rows, make_case
from test_kernel_wide_select import check_select, mask_dead, random_rows


def select(scores, g_lens, topk, bounds):
    """check_select's comparison (garbage past g_len included) on the bound path."""
    check_select(scores, g_lens, topk,
                 lambda s, lens, k: indexer.select_topk_triton(s, lens, k, method="bound", bounds=bounds))


@pytest.mark.parametrize("device", DEVICES)
def test_steps_keep_to_the_candidates_and_stay_exact(device, monkeypatch):
    """Rows that drift a little from step to step: the first step takes every score (no bound
    yet), later steps hit; rows shorter than k, empty rows and tie-heavy rows stay exact."""
    poison_empty(monkeypatch)
    width, topk = 3000, 40
    base = random_rows(width, seed=3)
    g_lens = torch.tensor([width, width - 5, 1500, 30, 0, width - 1], dtype=torch.int32)
    bounds = bound_state(8, device)
    noise = torch.Generator().manual_seed(4)
    misses = []
    for step in range(5):
        scores = base + 0.02 * torch.randn(base.shape, generator=noise) * base.abs().clamp(min=0.1)
        select(mask_dead(scores, g_lens).to(device), g_lens.to(device), topk, bounds)
        misses.append(bound_misses(bounds).cpu().clone())
    assert torch.isfinite(bounds[0, :3].cpu()).all()  # the long rows have a bound
    assert float(bounds[0, 4]) == float("-inf")  # the empty row never gets one
    # after the first step's guess the normal and trend rows never missed again
    assert torch.equal(misses[-1][[0, 4]], misses[1][[0, 4]])
    assert (bounds[1, :3].cpu() > 0).all()  # gaps


@pytest.mark.parametrize("device", DEVICES)
def test_wrong_bounds_take_the_whole_row(device, monkeypatch):
    """A bound above every score (no candidates) and one below every score with a capacity too
    small for them: both exact, both counted as misses, the next bound below the k-th score;
    the same scores again find a bound that fits within a few steps, and keep it."""
    monkeypatch.setattr(ws, "CAPACITY", 256)
    poison_empty(monkeypatch)
    width, topk = 2500, 24
    scores = torch.randn(2, width, generator=torch.Generator().manual_seed(7))
    g_lens = torch.tensor([width, width - 100], dtype=torch.int32)
    kth = [torch.topk(scores[0], topk).values[-1].item(), torch.topk(scores[1, :width - 100], topk).values[-1].item()]
    bounds = bound_state(2, device)
    bounds[0, 0], bounds[0, 1] = 100.0, -100.0
    bounds[1] = 0.1
    select(scores.to(device), g_lens.to(device), topk, bounds)
    assert bound_misses(bounds).tolist() == [1.0, 1.0]
    assert float(bounds[0, 0]) < kth[0] and float(bounds[0, 1]) < kth[1]
    for _ in range(4):
        select(scores.to(device), g_lens.to(device), topk, bounds)
    misses = bound_misses(bounds).tolist()
    assert max(misses) <= 4
    select(scores.to(device), g_lens.to(device), topk, bounds)
    assert bound_misses(bounds).tolist() == misses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_takes_candidates_in_the_scoring_launch(device, fp8, monkeypatch):
    """indexer_topk_triton with bounds: the scoring launch appends the candidates and stores the
    step's score scale; the same positions as the reference over steps with new queries; with
    WIDEEP_BOUND_SELECT off (BOUND_SELECT) the bounds are left alone."""
    monkeypatch.setattr(indexer, "FUSED_MAX_WIDTH", 0)
    poison_empty(monkeypatch)
    g_lens = [1000, 70, 0, 513]
    q, w, keys, tables, lens = make_case(device, g_lens, 64)
    scale = None
    if fp8:
        keys, scale = keys.to(torch.float8_e4m3fn), torch.rand(keys.shape[0], device=device) + 0.5
    bounds = bound_state(6, device)
    g = torch.Generator().manual_seed(9)
    for step, topk in enumerate((33, 33, 200, 33)):
        q = q + 0.05 * torch.randn(q.shape, generator=g).to(device)
        want = indexer.indexer_topk_reference(q, w, keys, tables, lens, 64, topk, key_scale=scale)
        got = indexer.indexer_topk_triton(q, w, keys, tables, lens, 64, topk, key_scale=scale, bounds=bounds)
        check_rows(got, want, g_lens, topk)
    qf, wf = q.float(), w.float()
    want_scale = (wf.clamp(min=0) * qf.norm(dim=2)).sum(1)
    torch.testing.assert_close(bounds[3, :4], want_scale.clamp(min=1e-20), rtol=1e-5, atol=0)
    assert torch.isfinite(bounds[0, [0, 3]]).all()
    monkeypatch.setattr(indexer, "BOUND_SELECT", False)
    before = bounds.clone()
    got = indexer.indexer_topk_triton(q, w, keys, tables, lens, 64, 33, key_scale=scale, bounds=bounds)
    check_rows(got, indexer.indexer_topk_reference(q, w, keys, tables, lens, 64, 33, key_scale=scale), g_lens, 33)
    assert torch.equal(bounds, before)


@pytest.mark.parametrize("device", DEVICES)
def test_scoring_launch_candidates_match_the_scores(device):
    """The scoring launch's candidates are exactly the live scores at or above bound * scale,
    with their positions, whatever programs append them; the count counts them all."""
    g_lens = [700, 129, 5]
    args = make_case(device, g_lens, 32)
    bounds = bound_state(3, device)
    bounds[0] = torch.tensor([0.05, -0.2, float("-inf")])
    hist, count, cand = bound_workspace(3, device)
    scores = score._score_launch(*args, 32, tile=32, num_warps=4, programs=3, bound=(bounds, count, cand))
    for b, n in enumerate(g_lens):
        tau = float(bounds[0, b] * bounds[3, b])
        keep = torch.nonzero(scores[b, :n] >= tau).flatten()
        assert int(count[b]) == len(keep)
        got_pos = cand[1][b, :len(keep)].long()
        assert sorted(got_pos.tolist()) == keep.tolist()
        assert torch.equal(cand[0][b, :len(keep)], scores[b, got_pos])


def test_bad_bounds_are_refused():
    scores = torch.zeros(2, 128)
    lens = torch.full((2,), 128, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs the rows' bounds"):
        indexer.select_topk_triton(scores, lens, 8, method="bound")
    for bad in (torch.zeros(3, 2), torch.zeros(4, 1), torch.zeros(4, 2, dtype=torch.float64),
                torch.zeros(2, 4).t()):
        with pytest.raises(ValueError, match="bounds must be"):
            check_bounds(bad, 2)
