"""The one-pass sampling kernel (Gumbel-max over Philox uniforms) against its torch reference,
and the reference against the distribution it must draw from."""
import math

import pytest
import torch

from kernel_devices import DEVICES

triton = pytest.importorskip("triton")

from wideep_kernels.race import (  # noqa: E402
    U_MAX, philox_uniform_reference, race_sample, race_sample_reference, race_sample_triton, race_scores_reference)


def test_the_reference_uniforms_are_tritons_philox():
    """Checked against Triton itself where it runs here (its interpreter on a CPU, a GPU)."""
    if not torch.cuda.is_available():
        from kernel_devices import INTERPRETING
        if not INTERPRETING:
            pytest.skip("no Triton to compare with")
    import triton.language as tl

    @triton.jit
    def uniforms(seeds_ptr, out_ptr, N: tl.constexpr):
        r = tl.program_id(0)
        t = tl.arange(0, N)
        tl.store(out_ptr + r * N + t, tl.rand(tl.load(seeds_ptr + r), t))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seeds = torch.tensor([0, 1, 7, 2 ** 33 + 5, -3, 2 ** 62 + 12345], dtype=torch.int64)
    out = torch.empty(len(seeds), 256, device=device)
    uniforms[(len(seeds),)](seeds.to(device), out, N=256)
    torch.testing.assert_close(out.cpu().clamp(max=U_MAX), philox_uniform_reference(seeds, 256), rtol=0, atol=0)


def test_the_reference_draws_from_the_softmax():
    """Over many seeds, each token comes up as often as softmax(l / T) says (within 5 sigma)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n, temperature = 20000, 0.7
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    tokens = race_sample_reference(logits, torch.zeros(n, dtype=torch.long), torch.full((n,), 1 / temperature), seeds)
    freq = torch.bincount(tokens, minlength=6).double() / n
    p = (logits[0] / temperature).softmax(-1).double()
    assert freq[4] == 0  # a cut token never comes up
    for f, q in zip(freq.tolist(), p.tolist()):
        assert abs(f - q) <= 5 * math.sqrt(q * (1 - q) / n) + 1e-12, (freq, p)


def _case(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, vocab, generator=g) * 3
    logits[1, : vocab // 2] = float("-inf")  # half the row cut (a top-k, a grammar)
    logits[3] = 0.0                          # a flat row: the uniforms alone decide
    rows = torch.tensor([5, 1, 3, 0])
    inv_t = torch.tensor([1.0, 2.5, 1.0, 1 / 3.4e38])  # the last: a temperature at fp32's largest
    seeds = torch.tensor([3, 2 ** 40 + 9, -17, 123456789], dtype=torch.int64)
    return logits, rows, inv_t, seeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [300, 4096 * 2 + 77])  # one chunk, and several with a ragged end
def test_the_kernel_draws_the_reference_tokens(device, vocab):
    logits, rows, inv_t, seeds = _case(vocab, seed=vocab)
    got = race_sample_triton(logits.to(device), rows.to(device), inv_t.to(device), seeds.to(device)).cpu()
    scores = race_scores_reference(logits, rows, inv_t, seeds)
    want = scores.argmax(-1)
    # the GPU's log may differ from torch's in the last bits: a different token is allowed only
    # where its score ties the reference's best within that
    for i, (a, b) in enumerate(zip(got.tolist(), want.tolist())):
        assert a == b or abs(scores[i, a] - scores[i, b]) <= 1e-5 * scores[i, b].abs(), (i, a, b)
    assert got[1] >= vocab // 2  # never a cut token
    bf16 = race_sample_triton(logits.to(device, torch.bfloat16), rows.to(device), inv_t.to(device),
                              seeds.to(device)).cpu()
    assert bf16[1] >= vocab // 2


def test_bad_arguments_are_refused():
    logits, rows, inv_t, seeds = _case(64, seed=1)
    with pytest.raises(ValueError, match="seeds"):
        race_sample(logits, rows, inv_t, seeds.int())
    with pytest.raises(ValueError, match="inv_temperature"):
        race_sample(logits, rows, inv_t[:2], seeds)
    with pytest.raises(ValueError, match="rows"):
        race_sample(logits, rows.float(), inv_t, seeds)


def test_the_sampler_takes_its_torch_draw_where_the_kernel_fails(monkeypatch):
    """A kernel that cannot be built here (a Triton release it was not checked on) hands the
    draw back to the sampler's torch path, not to the reference's slow Philox in torch."""
    import engine.sampling
    import wideep_kernels
    from engine.sampling import Sampler, SamplingParams

    def fails(*args):
        raise RuntimeError("no build")
    monkeypatch.setattr(engine.sampling, "triton_ok", lambda t: True)
    monkeypatch.setattr(engine.sampling, "race_sample_triton", fails)
    monkeypatch.setattr(wideep_kernels, "_unusable", set())
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=3)]
    tokens = Sampler()(logits, params, [None, None, torch.Generator().manual_seed(3)])
    assert tokens[1] == logits[1].argmax() and all(0 <= t < 50 for t in tokens)
    assert wideep_kernels._unusable == {"race"}
    again = Sampler()(logits, params, [None, None, torch.Generator().manual_seed(3)])
    assert again[2] == tokens[2]  # the torch draw of a seeded row, as before the kernel
