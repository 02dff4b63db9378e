"""Prompt log-probabilities (prompt_logprobs; the API's echo with logprobs): each prompt token's
record against transformers' logits, over prompts computed in several chunks, beside requests
that did not ask, and past the prefix cache."""
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.logprobs import prompt_logprob_rows
from engine.sampling import SamplingError, SamplingParams

transformers = pytest.importorskip("transformers")

TEXT = "The key value cache keeps what attention has already seen, so each new token costs little."


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    # 8 tokens a step: a prompt takes several chunks
    return LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, max_num_batched_tokens=8),
                                     progress=False)


def _greedy(n=2, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_records_match_transformers(tiny_ckpt, engine):
    prompt = engine.tokenizer.encode(TEXT)
    assert len(prompt) > 16
    out = engine.generate([prompt], _greedy(prompt_logprobs=3))[0]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    records = out.prompt_logprobs
    assert len(records) == len(prompt)
    assert records[0] == {"token_id": prompt[0], "token": engine.tokenizer.token_text(prompt[0]), "logprob": None,
                          "top": []}
    for p, record in enumerate(records[1:]):  # record p + 1: token p + 1 given tokens up to p
        assert record["token_id"] == prompt[p + 1]
        assert record["logprob"] == pytest.approx(ref[p, prompt[p + 1]].item(), abs=1e-4), p
        top = ref[p].topk(3)
        assert [t["token_id"] for t in record["top"]] == top.indices.tolist()
        assert [t["logprob"] for t in record["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert record["token"] == engine.tokenizer.token_text(prompt[p + 1])
        assert record["rank"] == 1 + int((ref[p] > ref[p, prompt[p + 1]]).sum()), p
    assert len({r["rank"] for r in records[1:]}) > 1  # ranks other than the top: the check can fail


def test_beside_other_requests_and_past_the_prefix_cache(engine):
    prompt = engine.tokenizer.encode(TEXT)
    other = engine.tokenizer.encode("Prefill reads the whole prompt at once; decode adds one token at a time.")
    alone = engine.generate([other], _greedy(6))[0].output_token_ids
    first, beside = engine.generate([prompt, other], [_greedy(4, prompt_logprobs=0), _greedy(6)])
    assert beside.output_token_ids == alone and beside.prompt_logprobs is None
    hits = engine.stats()["prefix_hit_tokens"]
    # the same prompt again: its blocks are cached, yet every position is computed for the records
    again = engine.generate([prompt], _greedy(4, prompt_logprobs=0))[0]
    assert engine.stats()["prefix_hit_tokens"] == hits
    assert [r["logprob"] for r in again.prompt_logprobs[1:]] == pytest.approx(
        [r["logprob"] for r in first.prompt_logprobs[1:]], abs=1e-5)
    assert again.output_token_ids == first.output_token_ids
    engine.generate([prompt], _greedy(1))  # a request without them still takes the cache
    assert engine.stats()["prefix_hit_tokens"] > hits
    assert engine.stats()["kv_blocks_used"] == 0


def test_echo_returns_the_prompt_text_once(engine):
    engine.add_request("echo", TEXT, _greedy(3, echo=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "echo"]
    assert outs[0].prompt_text == TEXT and all(o.prompt_text is None for o in outs[1:])


def test_a_recomputed_prompt_gets_no_second_records():
    """After preemption a prompt is computed again from its start: only positions without a
    record yet are taken."""
    seq = SimpleNamespace(prompt_ids=list(range(100, 110)), prompt_logprobs=[None] + [{}] * 5, num_computed_tokens=0,
                          needs_prompt_logprobs=True)
    other = SimpleNamespace(needs_prompt_logprobs=False)
    rows, targets, owners = prompt_logprob_rows([other, seq], [3, 10])
    # records exist for tokens 0..5: positions 5..8 predict tokens 6..9 (position 9 samples the output)
    assert rows == [3 + 5, 3 + 6, 3 + 7, 3 + 8] and targets == [106, 107, 108, 109] and owners == [(seq, 4)]


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_invalid_prompt_logprobs(value):
    with pytest.raises(SamplingError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
