"""Legacy completions with echo: the prompt comes back before the completion, with each prompt
token's log-probability when logprobs is set (as lm-eval's loglikelihood asks), whole and streamed."""
import json

import jsonschema
import pytest

from app.openapi import openapi_spec
from engine.sampling import SamplingParams
from tests.test_http_api import CHAT, COMPLETIONS, MODEL, client, offline, raw, served  # noqa: F401

PROMPT = "The quick brown fox jumps over the lazy dog."


def _schema(name):
    spec = openapi_spec(MODEL)
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


def test_echo_with_logprobs_scores_the_prompt(client, offline, raw):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True, ignore_eos=True)
    _schema("TextCompletion").validate(raw.post(COMPLETIONS, json=body).json())
    resp = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True})
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2,
                                                  prompt_logprobs=2))[0]
    (choice,) = resp.choices
    assert choice.text == PROMPT + want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [offline.tokenizer.token_text(t) for t in ids]
    prompt_records = want.prompt_logprobs[1:]
    assert lp.token_logprobs[1:len(ids)] == [r["logprob"] for r in prompt_records]
    for top, r in zip(lp.top_logprobs[1:len(ids)], prompt_records):
        assert top == {**{t["token"]: t["logprob"] for t in r["top"]}, r["token"]: r["logprob"]}
    # the prompt's offsets, then the completion's after the whole prompt
    assert lp.text_offset[:len(ids)] == sorted(lp.text_offset[:len(ids)]) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ids)] == len(PROMPT)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 3


def test_echo_streamed_equals_whole(client, raw):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    text, tokens, token_lps, offsets = "", [], [], []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        text += c.text
        if c.logprobs:
            tokens += c.logprobs.tokens
            token_lps += c.logprobs.token_logprobs
            offsets += c.logprobs.text_offset
    assert text == whole.text and text.startswith(PROMPT)
    assert tokens == whole.logprobs.tokens and token_lps == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset
    body = dict(kw, stream=True, ignore_eos=True)
    del body["extra_body"]
    events = [line[6:] for line in raw.post(COMPLETIONS, json=body).text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    schema = _schema("TextCompletionChunk")
    for event in events[:-1]:
        schema.validate(json.loads(event))


def test_echo_without_logprobs_and_with_token_ids(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True)
    assert resp.choices[0].text.startswith(PROMPT) and resp.choices[0].logprobs is None
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert by_ids.choices[0].text == resp.choices[0].text
    two = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, n=2, logprobs=0, seed=3)
    assert all(c.text.startswith(PROMPT) and len(c.logprobs.tokens) == len(ids) + 2 for c in two.choices)


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, offline, raw):
    ids = offline.tokenizer.encode(PROMPT)
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    resp = raw.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    _schema("TextCompletion").validate(data)
    (choice,) = data["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    assert data["usage"]["completion_tokens"] == 0 and data["usage"]["prompt_tokens"] == len(ids)
    with_token = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1,
                                           temperature=0)
    assert choice["logprobs"]["token_logprobs"] == with_token.choices[0].logprobs.token_logprobs[:len(ids)]
    events = [line[6:] for line in raw.post(COMPLETIONS, json=dict(body, stream=True)).text.splitlines()
              if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # without echo, 0 is still refused
    bad = raw.post(COMPLETIONS, json=dict(body, echo=False))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_on_both_endpoints(raw, offline):
    """vLLM's prompt_logprobs: per prompt token (the first null) the token's own entry with its rank
    and the k most likely alternatives, keyed by token id; the response's for chat, each choice's
    for completions; beside echo with fewer alternatives, each view shows its own number."""
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))[0].prompt_logprobs
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, prompt_logprobs=3, echo=True, logprobs=1, n=2)
    resp = raw.post(COMPLETIONS, json=body).json()
    _schema("TextCompletion").validate(resp)
    for choice in resp["choices"]:
        got = choice["prompt_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        for entry, record in zip(got[1:], want[1:]):
            own = entry[str(record["token_id"])]
            assert own["rank"] == record["rank"] and own["logprob"] == pytest.approx(record["logprob"], abs=1e-5)
            assert own["decoded_token"] == record["token"]
            tops = [str(t["token_id"]) for t in record["top"]]
            assert set(entry) == set(tops) | {str(record["token_id"])}
            assert [entry[t]["rank"] for t in tops] == [1, 2, 3]
        # echo's view of the same records: one alternative each (and the token itself)
        assert all(top is None or len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][:len(ids)])
    chat = raw.post(CHAT, json=dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                    prompt_logprobs=0)).json()
    _schema("ChatCompletion").validate(chat)
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    for bad, param in ((dict(body, stream=True), "prompt_logprobs"), (dict(body, prompt_logprobs=21), "prompt_logprobs"),
                       (dict(body, prompt_logprobs=-1), "prompt_logprobs")):
        r = raw.post(COMPLETIONS, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
