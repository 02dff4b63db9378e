"""Log-probabilities of sampled tokens: the engine's records against transformers' logits, and
the rows, widths and paths (async steps, a P/D hand-off) that carry them."""
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.logprobs import LOGPROB_FLOOR, logprob_records, token_logprobs
from engine.sampling import SamplingError, SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)


def _prompt(engine, text="The quick brown fox jumps over the lazy dog."):
    return engine.tokenizer.encode(text)


def _records(engine, prompts, params) -> dict[str, list[dict | None]]:
    """Every output's logprob records, by request (None where an output carried none)."""
    rids = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        rids.append(f"lp-{i}-{engine.num_steps}")
        engine.add_request(rids[-1], prompt, p)
    got = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                assert out.logprobs is None or len(out.logprobs) == len(out.new_token_ids)
                got[out.request_id].append(out.logprobs[0] if out.logprobs else None)
                assert out.logprobs is None or out.logprobs[0]["token_id"] == out.new_token_ids[0]
    return got


@pytest.mark.parametrize("k", [0, 1, 5])
def test_token_logprobs_are_the_log_softmax_and_its_top_k(k):
    logits = torch.randn(4, 50, dtype=torch.bfloat16)
    tokens = torch.tensor([3, 7, 11, 49])
    packed = token_logprobs(logits, tokens, [0, 2, 3], k)
    ref = logits.float().log_softmax(-1)
    assert packed.shape == (3, 1 + 2 * k)
    torch.testing.assert_close(packed[:, 0], ref[[0, 2, 3], tokens[[0, 2, 3]]])
    if k:
        top = ref[[0, 2, 3]].topk(k)
        torch.testing.assert_close(packed[:, 1:1 + k], top.values)
        assert packed[:, 1 + k:].long().tolist() == top.indices.tolist()
    records = logprob_records(packed.tolist(), [3, 11, 49], [k, 0, k], str)
    assert [r["token_id"] for r in records] == [3, 11, 49]
    assert [len(r["top"]) for r in records] == [k, 0, k]  # a row's own k, whatever the batch's widest
    assert all(r["token"] == str(r["token_id"]) for r in records)


def test_records_floor_a_token_ruled_out():
    (record,) = logprob_records([[float("-inf"), 0.0, 1.0]], [2], [1], str)
    assert record["logprob"] == LOGPROB_FLOOR and record["top"][0] == {"token_id": 1, "token": "1", "logprob": 0.0}


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_invalid_logprobs(value):
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_greedy_logprobs_match_transformers(tiny_ckpt, engine):
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    prompt = _prompt(engine)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    hf_tokens = out.sequences[0, len(prompt):].tolist()
    (records,) = _records(engine, [prompt], [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                            logprobs=4)]).values()
    assert [r["token_id"] for r in records] == hf_tokens
    for step, (record, logits) in enumerate(zip(records, out.logits)):
        ref = logits[0].float().log_softmax(-1)
        top = ref.topk(4)
        assert record["logprob"] == pytest.approx(ref[record["token_id"]].item(), abs=1e-4), step
        assert [t["token_id"] for t in record["top"]] == top.indices.tolist()
        assert [t["logprob"] for t in record["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
        # greedy: the sampled token is the most likely one
        assert record["top"][0]["token_id"] == record["token_id"]
        assert record["token"] == engine.tokenizer.token_text(record["token_id"])


def test_logprobs_are_the_models_not_the_temperatures(engine):
    """A sampled request reports the raw distribution: the same numbers as a greedy one over the
    same text."""
    prompt = _prompt(engine)
    got = _records(engine, [prompt, prompt], [SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                                              SamplingParams(max_tokens=1, temperature=5.0, seed=1, logprobs=3)])
    (greedy,), (hot,) = got.values()
    assert [t["token_id"] for t in greedy["top"]] == [t["token_id"] for t in hot["top"]]
    assert [t["logprob"] for t in hot["top"]] == pytest.approx([t["logprob"] for t in greedy["top"]], abs=1e-5)
    tops = {t["token_id"]: t["logprob"] for t in greedy["top"]}
    if hot["token_id"] in tops:
        assert hot["logprob"] == pytest.approx(tops[hot["token_id"]], abs=1e-5)
    else:
        assert hot["logprob"] <= min(tops.values())


def test_only_the_rows_that_asked_get_logprobs_each_its_own_width(engine):
    prompts = [_prompt(engine, t) for t in ("one two three", "a b c d e f", "hello there")]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=k) for k in (None, 0, 7)]
    got = list(_records(engine, prompts, params).values())
    assert got[0] == [None] * 6
    assert len(got[1]) == 6 and all(r["top"] == [] for r in got[1])
    assert len(got[2]) == 6 and all(len(r["top"]) == 7 for r in got[2])
    assert all(r["logprob"] <= 0 for rows in got[1:] for r in rows)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_launched_ahead_carry_the_same_logprobs(tiny_ckpt, engine, async_scheduling):
    """Decode steps launched before the previous step's tokens were read (async scheduling)
    report the logprobs of the tokens they sampled, as plain steps do."""
    ahead = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=async_scheduling),
                                      progress=False)
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    prompt = _prompt(engine, "Numbers 0 1 2 3 4 5 6 7 8 9")
    (want,) = _records(engine, [prompt], [p]).values()
    (got,) = _records(ahead, [prompt], [p]).values()
    assert ahead.num_steps_ahead > 0 if async_scheduling else ahead.num_steps_ahead == 0
    assert [r["token_id"] for r in got] == [r["token_id"] for r in want]
    assert [r["logprob"] for r in got] == pytest.approx([r["logprob"] for r in want], abs=1e-5)


def test_a_remote_first_tokens_record_reaches_the_output(engine):
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=1)
    res = engine.reserve_remote("remote-lp", _prompt(engine), p)
    record = {"token_id": 5, "token": "x", "logprob": -0.5, "top": [{"token_id": 5, "token": "x", "logprob": -0.5}]}
    out = engine.commit_remote("remote-lp", 5, record)
    assert res is not None and out.logprobs == [record] and out.stream_dict()["logprobs"] == [record]
    engine.abort_request("remote-lp")
    assert engine.stats()["kv_blocks_used"] == 0
