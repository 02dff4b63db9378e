"""The top-p cut by bisection over order keys against its sort-based reference."""
import pytest
import torch

from kernel_devices import DEVICES

triton = pytest.importorskip("triton")

from wideep_kernels.nucleus import nucleus_threshold_reference, nucleus_threshold_triton  # noqa: E402


def _rows(n, vocab, seed, scale=2.0):
    """Rows of distinct logits (sorted, strictly increasing steps added, shuffled)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=g) * scale).sort(-1).values + torch.arange(vocab) * 1e-3
    return x.gather(1, torch.stack([torch.randperm(vocab, generator=g) for _ in range(n)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [300, 5000])  # one block, and several (the kernel's blocks are 4096)
def test_matches_the_sort(device, vocab):
    n = 8
    logits = _rows(n, vocab, seed=vocab)
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999])
    floor = torch.full((n,), float("-inf"))
    floor[[2, 5]] = logits[[2, 5]].topk(40).values[:, -1]  # rows cut by top-k first: the nucleus of what is left
    ref = nucleus_threshold_reference(logits, floor, top_p)
    got = nucleus_threshold_triton(logits.to(device), floor.to(device), top_p.to(device)).cpu()
    assert torch.equal(got, ref), (got, ref)
    kept = (logits >= got[:, None]).sum(-1)
    assert len(set(kept.tolist())) > 4 and kept[0] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_odd_rows(device):
    vocab = 64
    logits = _rows(4, vocab, seed=1)
    logits[0, :] = -3.0                       # every logit tied: all kept
    logits[1, :vocab // 2] = float("-inf")    # tokens ruled out by a bias
    logits[2, 5] = 60.0                       # one token holds all the mass: it alone
    top_p = torch.tensor([0.5, 0.9, 0.9, 1.0])
    floor = torch.full((4,), float("-inf"))
    ref = nucleus_threshold_reference(logits, floor, top_p)
    got = nucleus_threshold_triton(logits.to(device), floor.to(device), top_p.to(device)).cpu()
    assert torch.equal(got, ref)
    assert (logits[0] >= got[0]).all() and (logits[2] >= got[2]).sum() == 1
    assert got[3] == logits[3].min()  # top_p 1 keeps the whole row
