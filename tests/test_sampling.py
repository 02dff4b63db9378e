import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import Sampler, SamplingError, SamplingParams
from kernel_devices import INTERPRETING


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(), progress=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"seed": "x"}, "seed"), ({"n": 2}, "n"), ({"stop": [""]}, "stop"), ({"stop": ["a"] * 1000}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_invalid_sampling_parameters(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    f = Sampler._filter(logits, [SamplingParams(top_k=2)])
    assert torch.isinf(f[0, [0, 3]]).all() and torch.isfinite(f[0, [1, 2]]).all()
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    f = Sampler._filter(probs, [SamplingParams(top_p=0.7)])
    assert torch.isfinite(f[0, :2]).all() and torch.isinf(f[0, 2:]).all()  # 0.5 + 0.3 reaches 0.7


MIXES = {
    "top_k": [dict(top_k=k) for k in (1, 5, 50, 400)],
    "top_p": [dict(top_p=p) for p in (0.1, 0.5, 0.9, 0.99)],
    "both": [dict(top_k=40, top_p=0.8), dict(top_k=3, top_p=0.99), dict(top_k=200, top_p=0.3)],
    # rows that filter nothing beside rows that do: the unfiltered rows must stay whole
    "mixed": [dict(), dict(top_k=8), dict(top_p=0.7), dict(top_k=20, top_p=0.9), dict(), dict(top_k=2000)],
    "wide_k": [dict(top_k=3000), dict(top_k=5)],  # past TOPK_LIMIT: the rows are sorted
}


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
@pytest.mark.parametrize("mix", list(MIXES))
def test_filter_keeps_the_same_tokens_as_sorting_whole_rows(mix, device, kernel, monkeypatch):
    """The top-k / top-p cuts found among each row's largest logits, or for a nucleus without a
    top-k by the nucleus kernel (the GPU's path; interpreted on a CPU), keep exactly the tokens
    that sorting whole rows keeps (distinct logits: the two may treat ties at the cut apart)."""
    import engine.sampling
    import wideep_kernels.nucleus
    if kernel and device == "cpu" and not INTERPRETING:
        pytest.skip("the kernel runs on a CPU only under TRITON_INTERPRET=1")
    for module in (engine.sampling, wideep_kernels.nucleus):
        monkeypatch.setattr(module, "triton_ok", lambda t: kernel)
    g = torch.Generator().manual_seed(3)
    rows = MIXES[mix] * 3
    vocab = 4096
    # each row's values distinct (sorted, strictly increasing steps added, then shuffled), spread
    # so that the top-p cuts fall anywhere from 2 to over a thousand tokens
    tail = (torch.randn(len(rows), vocab, generator=g) * 2).sort(-1).values + torch.arange(vocab) * 1e-3
    shuffle = torch.stack([torch.randperm(vocab, generator=g) for _ in rows])
    logits = tail.gather(1, shuffle).to(device)
    assert all(row.unique().numel() == vocab for row in logits)
    params = [SamplingParams(temperature=1.0, **kw) for kw in rows]
    fast = torch.isfinite(Sampler._filter(logits, params))
    ref = torch.isfinite(Sampler.filter_by_sort(logits, params))
    assert torch.equal(fast, ref)
    kept = fast.sum(-1).tolist()
    for kw, n in zip(rows, kept):
        if not kw:
            assert n == vocab  # untouched
        if kw.get("top_k"):
            assert n <= kw["top_k"]
    assert min(kept) >= 1 and len(set(kept)) > 1  # the cuts did cut, to different widths
    import wideep_kernels
    assert "nucleus_threshold" not in wideep_kernels._unusable  # the kernel ran, not its fallback


@pytest.mark.parametrize("extra", [{}, dict(top_p=0.5), dict(top_k=5, top_p=0.5), dict(top_k=3)])
def test_a_tiny_temperature_is_greedy(extra):
    """Logits divided by 1e-300 are infinities, whose softmax is NaN: such rows take the argmax."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1e-300, **extra)] * 3
    assert Sampler()(logits, params, [None] * 3) == logits.argmax(-1).tolist()
    # the filter alone, on such rows (NaN masses), still keeps their top tokens
    if extra:
        kept = Sampler._filter(logits / 1e-300, params) > float("-inf")
        assert kept.gather(1, logits.argmax(-1, keepdim=True)).all()


def test_greedy_rows_take_the_argmax_in_the_logits_dtype_first_index_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 50, generator=g) * 3).bfloat16()
    logits[2, [7, 31]] = 40.0  # a tie: the first index wins, as for the fp32 logits
    greedy = [SamplingParams(temperature=0)] * 6
    assert Sampler()(logits, greedy, [None] * 6) == logits.float().argmax(-1).tolist()
    assert Sampler()(logits, greedy, [None] * 6)[2] == 7
    # with one sampled row the greedy rows still get their argmax
    mixed = greedy[:5] + [SamplingParams(temperature=1.0, seed=1)]
    assert Sampler()(logits, mixed, [None] * 5 + [torch.Generator().manual_seed(1)])[:5] == \
        logits.float().argmax(-1).tolist()[:5]


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).log_softmax(-1).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, params, gens)), minlength=3).float() / 4000
    expect = torch.tensor([0.0, 1.0, 2.0]).softmax(-1)
    assert torch.allclose(counts, expect, atol=0.03)


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = engine.generate(["hello"], p)[0].output_token_ids
    batched = engine.generate(["hello", "other prompt", "x"], [p, SamplingParams(seed=1), SamplingParams()])
    assert batched[0].output_token_ids == alone
    other = engine.generate(["hello"], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8,
                                                      ignore_eos=True))[0]
    assert other.output_token_ids != alone


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(["hello"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    k1 = engine.generate(["hello"], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert greedy.output_token_ids == k1.output_token_ids


def test_stop_strings_and_stop_ids(engine):
    full = engine.generate(["hello"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = engine.generate(["hello"], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    tok = full.output_token_ids[4]
    by_id = engine.generate(["hello"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop"
    assert by_id.output_token_ids == full.output_token_ids[:full.output_token_ids.index(tok) + 1]


def test_max_tokens_and_streamed_text_adds_up(engine):
    engine.add_request("stream", "hello", SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    deltas, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.text_delta)
            last = out
    assert last.finished and last.finish_reason == "length"
    assert len(last.output_token_ids) == 9
    assert "".join(deltas) == last.text == engine.tokenizer.decode(last.output_token_ids)
