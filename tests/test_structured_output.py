"""Structured output: the mask kernel against its reference, and the engine's constrained choices
against the raw logits it recorded, restricted by hand to what a fresh matcher of the same grammar
allows at each step."""
import json
import re

from tests.kernel_devices import DEVICES  # noqa: I001  (turns the interpreter on first)

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling import SamplingError, SamplingParams
from engine.tokenizer import THINK_END
from tests.test_penalties import recording  # noqa: F401  (the engine recording its raw logits per step)
from wideep_kernels.token_mask import apply_token_mask_reference, apply_token_mask_triton, unpack_mask

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"]}
JSON_SPEC = {"kind": "json", "value": SCHEMA}
REGEX = r"\d{3}-[a-c]{2}"
PROMPT = [5, 9, 5, 17, 33, 9, 41]


# the kernel -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [37, 1024, 2085])
def test_mask_kernel_matches_the_reference(device, dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    words = (vocab + 31) // 32 + 1  # a wider mask than needed: the bits past vocab are ignored
    mask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = -1  # all allowed
    mask[1] = 0   # none allowed
    rows = torch.tensor([4, 0, 2])
    want = logits.clone()
    apply_token_mask_reference(want, mask, rows)
    got = logits.to(device)
    apply_token_mask_triton(got, mask.to(device), rows.to(device))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[[1, 3, 5]], logits[[1, 3, 5]]) and torch.equal(want[4], logits[4])
    assert torch.isinf(want[0]).all()
    allowed = unpack_mask(mask[2:], vocab)[0]
    assert torch.equal(torch.isinf(want[2]), ~allowed) and 0 < int(allowed.sum()) < vocab


def test_mask_kernel_refuses_bad_shapes():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="mask"):
        apply_token_mask_triton(logits, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows"):
        apply_token_mask_triton(logits, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]))


# the engine ------------------------------------------------------------------------------------

def _run(engine, requests: dict[str, tuple]):
    """Runs (prompt, params) per request id together; their final outputs and raw logits per step."""
    engine.recorded.clear()
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs, records = {}, {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            records[o.request_id] += o.logprobs or []
            if o.finished:
                outs[o.request_id] = o
                o.logprobs = records[o.request_id]  # every token's, not the last output's
    return outs, {rid: [step[rid] for step in engine.recorded if rid in step] for rid in requests}


def _params(spec, n=64, **kw):
    return SamplingParams(max_tokens=n, structured_output=spec, **kw)


def test_greedy_choices_are_the_argmax_of_what_the_grammar_allows(recording):
    spec = {"kind": "regex", "value": REGEX}
    outs, raw = _run(recording, {"re": (PROMPT, _params(spec, temperature=0)),
                                 "plain": (PROMPT, SamplingParams(max_tokens=7, temperature=0))})
    tokens = outs["re"].output_token_ids
    assert re.fullmatch(REGEX, outs["re"].text) and outs["re"].finish_reason == "stop"
    assert tokens[-1] == recording.eos_token_id  # the grammar ends on the stop token
    reference = recording.prompts.grammars.constraint({"kind": "regex", "value": REGEX, "reasoning_end": None})
    mask = torch.zeros(1, (recording.model_cfg.vocab_size + 31) // 32, dtype=torch.int32)
    for step, (logits, token) in enumerate(zip(raw["re"], tokens)):
        reference.fill(mask, 0)
        allowed = unpack_mask(mask, logits.numel())[0]
        assert token == logits.masked_fill(~allowed, float("-inf")).argmax().item(), f"step {step}"
        assert reference.accept(token)
    assert reference.finished
    assert not re.fullmatch(REGEX, outs["plain"].text)  # unconstrained it is something else: the mask bound


def _validate(value, schema) -> None:
    # imported here: the GPU machine's image lacks jsonschema, and the rest of this file runs there
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)


@pytest.mark.parametrize("spec, check", [
    (JSON_SPEC, lambda text: _validate(json.loads(text), SCHEMA)),
    ({"kind": "json_object"}, lambda text: isinstance(json.loads(text), dict) or pytest.fail(text)),
    ({"kind": "regex", "value": REGEX}, lambda text: re.fullmatch(REGEX, text) or pytest.fail(text)),
    ({"kind": "choice", "value": ["alpha", "beta", "gamma delta"]},
     lambda text: text in ("alpha", "beta", "gamma delta") or pytest.fail(text)),
    ({"kind": "grammar", "value": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'},
     lambda text: re.fullmatch(r"\(\d+(\+\d+)*\)", text) or pytest.fail(text)),
])
def test_sampled_outputs_follow_the_grammar(recording, spec, check):
    """Sampled at temperature 1 (every allowed token has a chance), beside an unconstrained request
    whose output must be the same as alone: the mask touches its own rows only."""
    requests = {f"s{i}": (PROMPT + [i + 50], _params(spec, n=96, temperature=1.0, seed=i)) for i in range(6)}
    requests["free"] = (PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True))
    outs, _ = _run(recording, requests)
    alone, _ = _run(recording, {"free-alone": requests["free"]})
    assert outs["free"].output_token_ids == alone["free-alone"].output_token_ids
    constrained = [o for rid, o in outs.items() if rid != "free"]
    for o in constrained:  # cut by max_tokens or not, every token followed the grammar
        reference = recording.prompts.grammars.constraint(SamplingParams(structured_output=spec).structured_output)
        assert all(reference.accept(t) for t in o.output_token_ids), o.text
        assert reference.finished == (o.finish_reason == "stop")
    stopped = [o for o in constrained if o.finish_reason == "stop"]
    assert len(stopped) >= 2, [(o.finish_reason, o.text) for o in constrained]
    for o in stopped:
        check(o.text)


def test_a_temperature_past_fp32s_range_still_keeps_to_the_grammar_and_min_tokens(recording):
    """A huge temperature (the API lets any finite one through, as vLLM does) is inf in fp32; the
    masked logits divided by it were NaN, which the argmax could pick: a token the grammar bars,
    or an end of sequence before min_tokens."""
    spec = {"kind": "regex", "value": REGEX}
    requests = {f"hot{i}": (PROMPT, _params(spec, temperature=1e300, seed=i)) for i in range(3)}
    requests["min"] = (PROMPT, SamplingParams(max_tokens=12, min_tokens=12, temperature=6.7e307, seed=5,
                                              stop_token_ids=list(range(40))))
    outs, _ = _run(recording, requests)
    for i in range(3):
        reference = recording.prompts.grammars.constraint({"kind": "regex", "value": REGEX, "reasoning_end": None})
        assert all(reference.accept(t) for t in outs[f"hot{i}"].output_token_ids), outs[f"hot{i}"].text
    assert len(outs["min"].output_token_ids) == 12 and outs["min"].finish_reason == "length"
    assert not set(outs["min"].output_token_ids) & (set(range(40)) | {recording.eos_token_id})


def test_logprobs_report_the_model_distribution_not_the_masked_one(recording):
    spec = {"kind": "choice", "value": ["alpha", "beta"]}
    outs, _ = _run(recording, {"c": (PROMPT, _params(spec, temperature=0, logprobs=5)),
                               "free": (PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=5))})
    constrained, free = outs["c"].logprobs[0], outs["free"].logprobs[0]
    assert outs["c"].text in ("alpha", "beta") and free["token_id"] != constrained["token_id"]
    # the same raw logits at the first position: the same alternatives, though the mask left one
    assert [t["token_id"] for t in constrained["top"]] == [t["token_id"] for t in free["top"]]
    assert constrained["logprob"] > float("-inf")


def test_the_grammar_ends_the_request_even_with_ignore_eos_and_a_cut_is_length(recording):
    spec = {"kind": "regex", "value": "[ab]{4}"}
    outs, _ = _run(recording, {"ign": (PROMPT, _params(spec, temperature=0, ignore_eos=True)),
                               "cut": (PROMPT, _params({"kind": "regex", "value": "[ab]{40}"}, n=5, temperature=0))})
    assert outs["ign"].finish_reason == "stop" and re.fullmatch("[ab]{4}", outs["ign"].text)
    assert outs["cut"].finish_reason == "length" and len(outs["cut"].output_token_ids) == 5
    assert recording.stats()["kv_blocks_used"] == 0


def test_the_grammar_starts_after_the_reasoning_end(recording):
    """A reasoning model thinks freely first: the mask applies from the marker's token on. The
    marker is forced first here by a logit bias, which the mask then overrides."""
    end = recording.tokenizer.encode(THINK_END)
    assert len(end) == 1
    spec = {"kind": "regex", "value": "[ab]{3}", "reasoning_end": THINK_END}
    outs, _ = _run(recording, {
        "think": (PROMPT, _params(spec, temperature=0, logit_bias={end[0]: 100.0})),
        "never": (PROMPT, _params(spec, n=6, temperature=0, ignore_eos=True))})
    assert outs["think"].output_token_ids[0] == end[0]
    assert re.fullmatch(re.escape(THINK_END) + "[ab]{3}", outs["think"].text), outs["think"].text
    assert not re.fullmatch("[ab]{3}", outs["never"].text)  # no marker: nothing constrained


def test_constrained_rows_run_ahead_and_match(tiny_ckpt):
    """A step launched ahead runs its forward before the token in flight is known; its masks, and
    so its sampling, wait for it. The outputs are those of stepping one at a time, for rows that
    stop at different steps (a stop token, the grammar's end, max_tokens) beside unconstrained ones."""
    ahead = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=True), progress=False)
    plain = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, async_scheduling=False), progress=False)
    params = [_params(JSON_SPEC, temperature=0.7, seed=5), _params({"kind": "regex", "value": REGEX}, temperature=0),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              _params({"kind": "choice", "value": ["alpha", "beta"]}, temperature=0.9, seed=2, frequency_penalty=1.0),
              _params({"kind": "regex", "value": "[ab]{50}"}, n=7, temperature=0, logprobs=2)]
    prompts = [PROMPT, PROMPT[1:], PROMPT[:3], PROMPT + [7], PROMPT[2:]]
    want = plain.generate(prompts, params)
    got = ahead.generate(prompts, params)
    assert [(o.output_token_ids, o.finish_reason) for o in got] == [(o.output_token_ids, o.finish_reason) for o in want]
    assert ahead.num_steps_ahead > 0 and plain.num_steps_ahead == 0
    assert ahead.stats()["kv_blocks_used"] == 0


def test_a_tokenizer_the_grammars_cannot_read_refuses_structured_requests_only(tiny_ckpt, monkeypatch, caplog):
    """The warm-up meets it first and goes on; each structured request is then refused with the
    reason (a RequestError: a 400), found once, and other requests are served."""
    import engine.prompts

    made = []

    def unreadable(*args, **kwargs):
        made.append(1)
        raise RuntimeError("no byte fallback")
    monkeypatch.setattr(engine.prompts, "GrammarCompiler", unreadable)
    eng = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                                                            warmup=False), progress=False)
    with caplog.at_level("WARNING"):
        eng.warmup()
    assert "not available with this model's tokenizer" in caplog.text
    for _ in range(2):
        with pytest.raises(RequestError, match="not available with this model's tokenizer: RuntimeError"):
            eng.add_request("json", PROMPT, _params({"kind": "json_object"}))
    assert made == [1]  # the tokenizer is read once, not per request
    out = eng.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 3 and eng.stats()["kv_blocks_used"] == 0


def test_a_retry_from_the_tokens_so_far_continues_the_grammar(recording):
    p = _params({"kind": "regex", "value": REGEX}, temperature=0)
    whole = _run(recording, {"whole": (PROMPT, p)})[0]["whole"]
    cut = 3
    resumed = {}
    recording.add_request("resumed", PROMPT + whole.output_token_ids[:cut], p,
                          prior_output_ids=whole.output_token_ids[:cut])
    while recording.has_unfinished_requests():
        resumed.update({o.request_id: o for o in recording.step()})
    assert whole.output_token_ids[:cut] + resumed["resumed"].output_token_ids == whole.output_token_ids
    bad = recording.tokenizer.encode("zz")
    with pytest.raises(RequestError, match="prior_output_ids"):
        recording.add_request("bad", PROMPT + bad, p, prior_output_ids=bad)
    assert "bad" not in recording.requests and recording.stats()["kv_blocks_used"] == 0


def test_compiles_are_counted_and_cached(recording):
    before = recording.stats()
    spec = {"kind": "regex", "value": "[a-c]{7}"}
    _run(recording, {"one": (PROMPT, _params(spec)), "two": (PROMPT[1:], _params(spec))})
    after = recording.stats()
    assert after["grammar_compiles"] == before.get("grammar_compiles", 0) + 1  # the second found it compiled
    assert after["grammar_compile_s"] > before.get("grammar_compile_s", 0)


@pytest.mark.parametrize("spec, match", [
    ({"kind": "json", "value": {"type": "nope"}}, "json cannot be compiled: Unsupported type"),
    ({"kind": "json", "value": "{not json"}, "json cannot be compiled"),
    ({"kind": "regex", "value": "(ab"}, "regex cannot be compiled"),
    ({"kind": "grammar", "value": "no rules here"}, "grammar cannot be compiled"),
    ({"kind": "regex", "value": "a", "reasoning_end": "two words"}, "not one token"),
    ({"kind": "grammar", "value": 'root ::= root "a"'}, "allows no first token"),
    ({"kind": "json", "value": False}, "cannot accept any value"),
])
def test_grammars_that_do_not_compile_are_refused_at_admission(recording, spec, match):
    with pytest.raises(RequestError, match=match):
        recording.add_request("bad", PROMPT, _params(spec))
    assert "bad" not in recording.requests and recording.stats()["kv_blocks_used"] == 0


def _nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize("spec, match", [
    ("json", "must be an object"), ({"kind": "xml"}, "kind must be one of"),
    ({"kind": "json", "value": 5}, "JSON schema"), ({"kind": "choice", "value": []}, "choice"),
    ({"kind": "choice", "value": ["a", 3]}, "choice"), ({"kind": "regex", "value": ""}, "regex"),
    ({"kind": "regex", "value": "a", "extra": 1}, "unknown keys"),
    ({"kind": "regex", "value": "a" * 300_000}, "longer than"),
    ({"kind": "choice", "value": ["a" * 1000] * 300}, "longer than"),
    # nested past what compiles in good time (the cube of the depth), as an object or its text;
    # 2000 levels also passed what json.dumps could write on Python 3.11, not on 3.12
    ({"kind": "json", "value": _nested(2000)}, "nests deeper than 128 levels"),
    ({"kind": "json", "value": json.dumps(_nested(65))}, "nests deeper than 128 levels"),
    ({"kind": "structural_tag", "value": {"format": {"type": "x", "deep": json.loads(json.dumps(_nested(70)))}}},
     "nests deeper"),
])
def test_malformed_specs_are_sampling_errors(spec, match):
    with pytest.raises(SamplingError, match=f"structured_output.*{match}"):
        SamplingParams(structured_output=spec)


def test_nesting_within_the_limit_is_taken_and_brackets_in_strings_do_not_count():
    deep = _nested(63)  # 127 levels of objects
    deep["description"] = "[[[[{{{{" * 40
    spec = SamplingParams(structured_output={"kind": "json", "value": deep}).structured_output
    assert json.loads(spec["value"]) == deep
