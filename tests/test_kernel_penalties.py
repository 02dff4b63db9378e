"""The penalties kernel against its torch reference and against the formula by hand."""
import pytest
import torch

from kernel_devices import DEVICES

triton = pytest.importorskip("triton")

from wideep_kernels.penalties import apply_penalties, apply_penalties_reference, apply_penalties_triton  # noqa: E402


def _case(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(7, vocab, generator=g) * 4
    logits[2, ::5] = float("-inf")  # tokens a bias or a grammar already ruled out
    counts = torch.randint(0, 4, (5, vocab), generator=g).float() * (torch.rand(5, vocab, generator=g) < 0.2)
    in_prompt = torch.rand(5, vocab, generator=g) < 0.1
    rows = torch.tensor([6, 0, 2, 3])           # not every row, not in order
    count_rows = torch.tensor([4, 1, 0, 1])     # two rows sharing counts is allowed: they are only read
    params = torch.tensor([[1.3, 0.5, 0.25], [1.0, -1.0, 0.0], [0.7, 0.0, 2.0], [1.0, 0.0, 0.0]])
    return logits, rows, count_rows, counts, in_prompt, params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [300, 2048 * 3 + 5])  # one program a row, and several with a ragged end
def test_matches_the_reference(device, vocab):
    logits, rows, count_rows, counts, in_prompt, params = _case(vocab, seed=vocab)
    want = logits.clone()
    apply_penalties_reference(want, rows, count_rows, counts, in_prompt, params)
    got = logits.clone().to(device)  # .to() of a CPU tensor to the CPU is the tensor itself
    apply_penalties_triton(got, rows.to(device), count_rows.to(device), counts.to(device), in_prompt.to(device),
                           params.to(device))
    got = got.cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same roundings, -inf where it was
    untouched = [1, 4, 5]
    assert torch.equal(got[untouched], logits[untouched])
    assert not torch.equal(got[6], logits[6]) and torch.equal(got[3], logits[3])  # row 3's penalties are neutral


def test_the_reference_is_the_formula():
    vocab = 16
    logits = torch.linspace(-2, 2, vocab)[None].clone()
    counts = torch.zeros(1, vocab)
    counts[0, [3, 12]] = torch.tensor([2.0, 1.0])
    in_prompt = torch.zeros(1, vocab, dtype=torch.bool)
    in_prompt[0, [3, 5, 14]] = True
    want = logits.clone()
    for t in (3, 5, 12, 14):  # seen: in the output or the prompt
        want[0, t] = want[0, t] / 1.5 if want[0, t] > 0 else want[0, t] * 1.5
    want[0] -= 0.4 * counts[0] + 0.3 * (counts[0] > 0).float()
    apply_penalties_reference(logits, torch.tensor([0]), torch.tensor([0]), counts, in_prompt,
                              torch.tensor([[1.5, 0.4, 0.3]]))
    torch.testing.assert_close(logits, want)


def test_bad_arguments_are_refused():
    logits, rows, count_rows, counts, in_prompt, params = _case(64, seed=1)
    with pytest.raises(ValueError, match="logits"):
        apply_penalties(logits.half(), rows, count_rows, counts, in_prompt, params)
    with pytest.raises(ValueError, match="in_prompt"):
        apply_penalties(logits, rows, count_rows, counts, in_prompt[:, :10], params)
    with pytest.raises(ValueError, match="params"):
        apply_penalties(logits, rows, count_rows, counts, in_prompt, params[:, :2])
    with pytest.raises(ValueError, match="count_rows"):
        apply_penalties(logits, rows, count_rows[:2], counts, in_prompt, params)
