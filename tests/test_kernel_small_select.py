import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from wideep_kernels import small_select as ss  # noqa: E402
from wideep_kernels.indexer import select_topk_reference, select_topk_triton  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def rows(width, seed, device):
    """Scores from few values (ties at the k-th), a row of zeros, -0.0 against +0.0, one binade,
    short and empty rows (-inf past g_len), and distinct ones."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (6, width), generator=g).float() / 8
    scores[1] = 0.0
    scores[2, ::3] = -0.0
    scores[3] = 1.0 + torch.randint(0, 64, (width,), generator=g).float() / 4096
    scores[5] = torch.randn(width, generator=g)
    g_lens = torch.tensor([width, width - 5, width // 2, width - 1, 0, width - 3], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    return scores.to(device), g_lens.to(device)


def same_sets(got, want):
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,topk", [(1500, 100), (1500, 700), (1500, 1500), (700, 900), (2100, 5), (64, 16)])
def test_matches_the_reference(device, width, topk):
    """Ties at the k-th (latest first), rows shorter than k, an empty row, -0.0 as 0.0; -1 after
    each row's positions."""
    scores, g_lens = rows(width, width + topk, device)
    out = torch.full((scores.shape[0], topk), 12345, dtype=torch.int32, device=device)
    ss.small_select(scores, g_lens, out, min(topk, width))
    same_sets(out, select_topk_reference(scores, g_lens, topk))


@pytest.mark.parametrize("device", DEVICES)
def test_the_indexer_takes_it_for_few_narrow_rows(device, monkeypatch):
    """With MAX_ROWS set, batches that small and rows that narrow go here (the dead positions'
    contents never read); more rows or wider ones keep the one-launch select."""
    monkeypatch.setattr(ss, "MAX_ROWS", 4)
    assert ss.use_small_select(4, 16384) and not ss.use_small_select(5, 8192)
    assert not ss.use_small_select(1, 16385) and not ss.use_small_select(0, 8192)
    import wideep_kernels.indexer as ix
    calls, real = [], ix.small_select
    monkeypatch.setattr(ix, "small_select", lambda *a: (calls.append(1), real(*a))[1])
    width, topk = 1200, 300
    scores, g_lens = rows(width, 7, device)
    scores = scores[:4].clone()
    g_lens = g_lens[:4].clone()
    scores[0, 1190:] = float("nan")  # past g_len: never read
    g_lens[0] = 1190
    got = select_topk_triton(scores, g_lens, topk)
    assert len(calls) == 1
    select_topk_triton(torch.cat([scores, scores[:1]]), torch.cat([g_lens, g_lens[:1]]), topk)
    assert len(calls) == 1  # five rows: the one-launch select
    same_sets(got, select_topk_reference(scores.nan_to_num(nan=float("-inf")), g_lens, topk))


def test_bad_arguments_are_refused():
    scores = torch.zeros(1, ss.MAX_WIDTH + 1)
    out = torch.empty(1, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="wider"):
        ss.small_select(scores, torch.ones(1, dtype=torch.int32), out, 16)
    with pytest.raises(ValueError, match="k must be"):
        ss.small_select(torch.zeros(1, 32), torch.ones(1, dtype=torch.int32), out, 17)
