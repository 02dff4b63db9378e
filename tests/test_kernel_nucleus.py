"""The top-p cut by splitting the order keys' interval, against its sort-based reference."""
import pytest
import torch

from kernel_devices import DEVICES

triton = pytest.importorskip("triton")

from wideep_kernels import nucleus  # noqa: E402
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


@pytest.mark.parametrize("device", DEVICES)
# the programs a row's 4 chunks are spread over: 4, 2, 2 (one holding a chunk past the row's end), 1
@pytest.mark.parametrize("wanted", [128, 9, 7, 1])
def test_wide_rows_in_many_chunks_and_bf16(device, wanted, monkeypatch):
    """A vocabulary of many chunks (DeepSeek's 129,280 is 32 of them) and odd ends, added up by
    programs of one chunk or several; bf16 logits as the model gives them, ties and all."""
    monkeypatch.setattr(nucleus, "_PROGRAMS_WANTED", wanted)
    n, vocab = 6, 3 * 4096 + 77
    assert nucleus.chunks_per_program(n, 4) == {128: 1, 9: 2, 7: 3, 1: 4}[wanted]
    logits = torch.cat([_rows(3, vocab, seed=7, scale=3.0), _rows(3, vocab, seed=8, scale=0.3)])
    top_p = torch.tensor([0.2, 0.6, 0.9, 0.95, 0.99, 0.7])
    floor = torch.full((n,), float("-inf"))
    floor[5] = logits[5].topk(300).values[-1]
    ref = nucleus_threshold_reference(logits, floor, top_p)
    got = nucleus_threshold_triton(logits.to(device), floor.to(device), top_p.to(device)).cpu()
    assert torch.equal(got, ref), (got, ref)
    kept = (logits >= got[:, None]).sum(-1)
    assert kept.max() > 4096  # a nucleus wider than a chunk
    half = logits[:2].to(torch.bfloat16)  # ties: every tied logit at the cut is kept
    ref = nucleus_threshold_reference(half, floor[:2], top_p[:2])
    got = nucleus_threshold_triton(half.to(device), floor[:2].to(device), top_p[:2].to(device)).cpu()
    assert torch.equal(got, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_a_strided_batch_and_infinite_logits(device):
    """Rows taken from a wider tensor (the sampler's rows of a batch), and a row made infinite by a
    tiny temperature: its infinite logits alone are kept, as the sort keeps its top."""
    wide = _rows(3, 2 * 700, seed=3)
    logits = wide[:, ::2]
    logits[1, 10] = logits[1, 20] = float("inf")
    top_p = torch.tensor([0.5, 0.9, 0.97])
    floor = torch.full((3,), float("-inf"))
    ref = nucleus_threshold_reference(logits, floor, top_p)
    got = nucleus_threshold_triton(logits.to(device), floor.to(device), top_p.to(device)).cpu()
    assert torch.equal(got, ref) and got[1] == float("inf")
    with pytest.raises(ValueError):
        nucleus_threshold_triton(logits.to(device), floor[:2].to(device), top_p.to(device))


def _exact_kept(logits, top_p):
    """Tokens each row keeps, its masses added in fp64: the cut the kernel and the fp32 sort both
    approximate. Over tens of thousands of tokens the fp32 sort's running sum drifts by more than a
    token's mass (the rows below: 1 token off in two of six; at 129,280 tokens up to 13); the
    kernel's sums (each program's 512 running sums, then the programs') matched fp64 in the rows below,
    and at 129,280 tokens in all but 1 of 81 random rows on an H100 (bench.nucleus_ab)."""
    ordered = logits.double().sort(-1, descending=True).values
    probs = ordered.softmax(-1)
    kept = ((probs.cumsum(-1) - probs) < top_p[:, None].double()).sum(-1, keepdim=True).clamp(min=1)
    return (logits >= ordered.gather(1, kept - 1).float()).sum(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_a_wide_vocabulary_against_fp64_sums(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(3, 40_000, generator=g), torch.randn(3, 40_000, generator=g) * 3])
    top_p = torch.tensor([0.5, 0.95, 0.99] * 2)
    floor = torch.full((6,), float("-inf"))
    got = nucleus_threshold_triton(logits.to(device), floor.to(device), top_p.to(device)).cpu()
    assert torch.equal((logits >= got[:, None]).sum(-1), _exact_kept(logits, top_p))
    assert torch.isin(got, logits).all()  # each cut is a logit of its row
