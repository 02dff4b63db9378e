"""Presence, frequency and repetition penalties and logit bias: the adjustment against its
formula, and the engine's choices against the raw logits it recorded, adjusted by hand."""
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.penalties import TokenCounts, adjust_logits
from engine.sampling import SamplingError, SamplingParams


@pytest.fixture(scope="module")
def recording(tiny_ckpt):
    """An engine whose raw logits per step and request are kept, before any adjustment."""
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    engine.recorded = []
    sample = engine.runner.sample

    def record(seqs, logits):
        engine.recorded.append({s.request_id: logits[i].float().clone() for i, s in enumerate(seqs)})
        return sample(seqs, logits)
    engine.runner.sample = record
    return engine


def _run(engine, rid, prompt, params):
    engine.recorded.clear()
    engine.add_request(rid, prompt, params)
    out = None
    while engine.has_unfinished_requests():
        out = {o.request_id: o for o in engine.step()}.get(rid, out)
    return out.output_token_ids, [step[rid] for step in engine.recorded if rid in step]


def _greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


PROMPT = [5, 9, 5, 17, 33, 9, 41]


def _seq(prompt, output, **params):
    return SimpleNamespace(prompt_ids=prompt, output_ids=list(output), params=SamplingParams(**params),
                           penalty_row=None, penalty_counted=0, is_finished=False, prior_output_ids=[])


def test_adjustment_follows_the_formula_and_leaves_the_raw_logits():
    vocab = 12
    logits = torch.linspace(-3, 3, 2 * vocab).reshape(2, vocab).to(torch.bfloat16)
    raw = logits.clone()
    p0 = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={3: -7.5})
    p1 = SamplingParams(logit_bias={0: 4.0})
    counts = TokenCounts(vocab, torch.device("cpu"))
    got = adjust_logits(logits, [p0, p1], counts, counts.rows([_seq([1, 11], [2, 2, 10, 2], repetition_penalty=2.0)]))
    assert torch.equal(logits, raw)
    want = raw.float().clone()
    c = torch.bincount(torch.tensor([2, 2, 10, 2]), minlength=vocab).float()
    for t in (1, 11, 2, 10):  # seen in the prompt or the output
        want[0, t] = want[0, t] / 2 if want[0, t] > 0 else want[0, t] * 2
    want[0] -= 0.25 * c + 0.5 * (c > 0).float()
    want[0, 3] -= 7.5
    want[1, 0] += 4.0
    torch.testing.assert_close(got, want)


def _bincount(ids, vocab=8):
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab).float().tolist()


def test_counts_grow_by_the_new_tokens_only_and_rows_are_reused():
    counts = TokenCounts(8, torch.device("cpu"))

    def read(seqs):
        rows = counts.rows(seqs)
        return counts.counts[rows].tolist(), counts.seen(rows)

    a, b = _seq([2], [1, 1, 3], frequency_penalty=1.0), _seq([2, 5], [4, 4], repetition_penalty=1.3)
    c, seen = read([a, b])
    assert c == [_bincount([1, 1, 3]), _bincount([4, 4])]
    assert seen[0].nonzero().flatten().tolist() == [1, 3]  # no repetition penalty: the prompt is not "seen"
    assert seen[1].nonzero().flatten().tolist() == [2, 4, 5]
    a.output_ids += [1, 7]
    counts.rows([b, a])
    c, _ = read([a])  # nothing new: nothing counted twice
    assert c == [_bincount([1, 1, 3, 1, 7])]
    many = [_seq([0], [i % 8], presence_penalty=1.0) for i in range(20)]  # more rows than made at first
    c, _ = read(many)
    assert c == [_bincount([i % 8]) for i in range(20)]
    a.is_finished = True
    fresh = _seq([0], [6, 6, 6], frequency_penalty=1.0)
    c, _ = read([fresh])
    assert fresh.penalty_row == a.penalty_row and c == [_bincount([6, 6, 6])]  # a's row, cleared


@pytest.mark.parametrize("kwargs", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                    dict(repetition_penalty=3.0), dict(frequency_penalty=-2.0),
                                    dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.5)])
def test_each_greedy_choice_is_the_argmax_of_the_adjusted_logits(recording, kwargs):
    plain, _ = _run(recording, "plain", PROMPT, _greedy(16))
    tokens, raw = _run(recording, "pen", PROMPT, _greedy(16, **kwargs))
    assert len(raw) == len(tokens) == 16
    p = SamplingParams(**kwargs)
    for i, (logits, token) in enumerate(zip(raw, tokens)):
        c = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=logits.numel()).float()
        seen = (c > 0).clone()
        seen[PROMPT] = True
        want = torch.where(seen, torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty),
                           logits) - p.frequency_penalty * c - p.presence_penalty * (c > 0).float()
        assert token == want.argmax().item(), f"step {i}"
    assert tokens != plain  # the penalty changed something, so the check above was not vacuous


def test_logit_bias_forces_and_forbids_tokens(recording):
    plain, _ = _run(recording, "plain-b", PROMPT, _greedy(6))
    forced, _ = _run(recording, "force", PROMPT, _greedy(6, logit_bias={77: 100.0}))
    assert forced == [77] * 6
    banned = sorted(set(plain))
    avoided, _ = _run(recording, "ban", PROMPT, _greedy(6, logit_bias={t: -100.0 for t in banned}))
    assert not set(avoided) & set(banned)
    sampled, _ = _run(recording, "force-sampled", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3,
                                                                         ignore_eos=True, logit_bias={77: 100.0}))
    assert sampled == [77] * 6


def test_penalized_rows_run_ahead_and_match(tiny_ckpt):
    """A step launched ahead does not know the token in flight, which penalties count: its forward
    runs ahead, its sampling waits for that token. The outputs are those of stepping one at a time."""
    ahead = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=True), progress=False)
    plain = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=False), progress=False)
    params = [_greedy(12, frequency_penalty=1.0), _greedy(9), _greedy(14, presence_penalty=2.0, repetition_penalty=1.3),
              SamplingParams(max_tokens=12, temperature=0.9, seed=4, frequency_penalty=2.0, ignore_eos=True)]
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:], PROMPT + [3]]
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    assert [o.output_token_ids for o in ahead.generate(prompts, params)] == want
    assert ahead.num_steps_ahead > 0 and plain.num_steps_ahead == 0
    assert want[0] != plain.generate([PROMPT], _greedy(12))[0].output_token_ids  # the penalty changed something


@pytest.mark.parametrize("kwargs, match", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
])
def test_invalid_penalties(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_logit_bias_outside_the_vocabulary_is_refused_at_admission(recording):
    vocab = recording.model_cfg.vocab_size
    with pytest.raises(RequestError, match="logit_bias"):
        recording.add_request("outside", PROMPT, _greedy(2, logit_bias={vocab: 1.0}))
    assert "outside" not in recording.requests and recording.stats()["kv_blocks_used"] == 0


def test_a_retry_from_the_tokens_so_far_still_counts_them(tiny_ckpt):
    """A decode group retries a request whose rank failed from its prompt plus the tokens produced
    so far: with those named as prior outputs the continuation is the uninterrupted one's."""
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    p = dict(frequency_penalty=1.5, presence_penalty=0.5)
    whole = engine.generate([PROMPT], _greedy(16, **p))[0].output_token_ids
    cut = 6
    resumed = PROMPT + whole[:cut]

    def retry(rid, prior):
        engine.add_request(rid, resumed, _greedy(16 - cut, **p), prior_output_ids=prior)
        out = None
        while engine.has_unfinished_requests():
            out = {o.request_id: o for o in engine.step()}.get(rid, out)
        return out.output_token_ids
    assert retry("counted", whole[:cut]) == whole[cut:]
    assert retry("forgotten", None) != whole[cut:]  # without them the penalties differ: the check can fail
    for bad in ([999_999], whole[1:cut] + [whole[0] + 1], [True]):  # not the prompt's end
        with pytest.raises(RequestError, match="prior_output_ids"):
            engine.add_request("bad", resumed, _greedy(2, **p), prior_output_ids=bad)
    assert engine.stats()["kv_blocks_used"] == 0


def test_min_tokens_holds_back_the_stop_tokens_and_strings(recording):
    """Until min_tokens are out, the end-of-sequence and stop tokens cannot be sampled (forced by a
    bias here) and stop strings do not end the answer; after, they do."""
    eos = recording.eos_token_id
    forced_eos = dict(logit_bias={eos: 100.0})
    early, _ = _run(recording, "early", PROMPT, SamplingParams(max_tokens=20, temperature=0, **forced_eos))
    assert early == [eos]
    held, _ = _run(recording, "held", PROMPT, SamplingParams(max_tokens=20, temperature=0, min_tokens=5, **forced_eos))
    assert len(held) == 6 and held[-1] == eos and eos not in held[:5]
    stop_token = 77
    held, _ = _run(recording, "held-stop", PROMPT, SamplingParams(max_tokens=20, temperature=0.8, seed=1, min_tokens=4,
                                                                  stop_token_ids=[stop_token],
                                                                  logit_bias={stop_token: 100.0}))
    assert held == [t for t in held[:4] if t != stop_token] + [stop_token] and len(held) == 5
    plain = recording.generate([PROMPT], _greedy(8))[0]
    stop = recording.tokenizer.decode(plain.output_token_ids[:2])  # a stop string met at once, held back
    assert stop
    cut = recording.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.output_token_ids == plain.output_token_ids[:2] and cut.text == ""
    held = recording.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop],
                                                       min_tokens=8))[0]
    assert held.output_token_ids == plain.output_token_ids and held.finish_reason == "length"
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert recording.stats()["kv_blocks_used"] == 0


def test_min_tokens_rows_run_ahead_and_match(tiny_ckpt):
    ahead = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=True), progress=False)
    plain = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=False), progress=False)
    eos = plain.eos_token_id
    params = [SamplingParams(max_tokens=12, temperature=0, min_tokens=k, logit_bias={eos: 8.0}) for k in (0, 3, 6)]
    want = [o.output_token_ids for o in plain.generate([PROMPT] * 3, params)]
    assert [o.output_token_ids for o in ahead.generate([PROMPT] * 3, params)] == want
    assert len(set(map(len, want))) == 3 and ahead.num_steps_ahead > 0
