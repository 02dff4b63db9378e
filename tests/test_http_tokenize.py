"""vLLM's /tokenize and /detokenize: the token ids the engine runs for a prompt or a
conversation (its usage counts them), the text of ids, and the bad forms of each as 400s."""
import json

import jsonschema
import pytest

from app.openapi import openapi_spec
from tests.test_http_api import CHAT, COMPLETIONS, MODEL, offline, raw, served  # noqa: F401

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _validate(name, obj):
    spec = openapi_spec(MODEL)
    jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]}
                                    ).validate(obj)


def test_tokenize_counts_what_a_request_runs(raw, offline):
    text = "The quick brown fox jumps over the lazy dog."
    resp = raw.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    _validate("TokenizeResponse", resp)
    assert resp["tokens"] == offline.tokenizer.encode(text) and resp["count"] == len(resp["tokens"])
    assert resp["token_strs"] == [offline.tokenizer.token_text(t) for t in resp["tokens"]]
    assert resp["max_model_len"] == offline.max_model_len
    used = raw.post(COMPLETIONS, json={"model": MODEL, "prompt": text, "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == resp["count"]
    for extra in ({}, {"tools": [TOOL]}, {"chat_template_kwargs": {"thinking": True}}):
        tok = raw.post("/tokenize", json={"messages": MESSAGES, **extra}).json()
        assert tok["token_strs"] is None
        chat = raw.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **extra}).json()
        assert chat["usage"]["prompt_tokens"] == tok["count"], extra
    with_tool = raw.post("/tokenize", json={"messages": MESSAGES, "tools": [TOOL]}).json()["count"]
    assert with_tool > raw.post("/tokenize", json={"messages": MESSAGES}).json()["count"]


def test_detokenize_gives_back_the_text(raw, offline):
    ids = offline.tokenizer.apply_chat_template(MESSAGES)
    resp = raw.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    _validate("DetokenizeResponse", resp)
    assert resp["prompt"] == offline.tokenizer.hf.decode(ids) and "What is the weather" in resp["prompt"]
    assert offline.tokenizer.hf.bos_token in resp["prompt"]  # special tokens included
    assert raw.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies_are_openai_errors(raw, path, body, status, param):
    resp = raw.post(path, content=json.dumps(body))
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_the_key_is_required(served):
    import httpx2 as httpx
    assert httpx.post(served.url + "/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
