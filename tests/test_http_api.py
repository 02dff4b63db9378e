"""The OpenAI HTTP API over a real tiny engine, served by uvicorn and called with the openai client."""
import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx2 as httpx
import openai
import pytest
import uvicorn
from starlette.datastructures import Headers

from app.http import build_http_app, pick_session_id
from app.service import Overloaded, api_error_from
from app.local_backend import LocalBackend
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

MODEL = "tiny-test"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 256
MAX_BODY = 100_000
ENGINE_CFG = dict(block_size=4, max_model_len=MAX_MODEL_LEN)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def served(tiny_ckpt):
    with serving(tiny_ckpt, ENGINE_CFG) as s:
        yield s


@contextlib.contextmanager
def serving(tiny_ckpt, engine_cfg: dict):
    """The HTTP app on a tiny engine of this configuration, behind uvicorn on a free port."""
    async_engine = AsyncLLMEngine(LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**engine_cfg), progress=False))
    backend = LocalBackend(async_engine, MODEL)
    app = build_http_app(backend, api_key=API_KEY, max_body_bytes=MAX_BODY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    host, port = sock.getsockname()
    yield SimpleNamespace(url=f"http://{host}:{port}", port=port, engine=async_engine, backend=backend)
    server.should_exit = True
    thread.join(timeout=10)
    async_engine.shutdown()
    sock.close()


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE_CFG), progress=False)


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(api_key=API_KEY, base_url=served.url + "/v1", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def raw(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as c:
        yield c


def greedy(max_tokens, **extra):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the fox."}]


# --- happy paths ---------------------------------------------------------------------------

def test_chat_greedy_matches_engine_and_counts_usage(client, offline):
    expect = offline.generate([MESSAGES], greedy(10))[0]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expect.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(offline.tokenizer.apply_chat_template(MESSAGES))
    assert resp.usage.completion_tokens == 10
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 10


def test_chat_content_parts_are_joined_text(client, offline):
    parts = [{"type": "text", "text": "Say hello"}, {"type": "text", "text": "to the fox."}]
    joined = [{"role": "user", "content": "Say hello\nto the fox."}]
    expect = offline.generate([joined], greedy(6))[0]
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                          max_completion_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == expect.text
    assert resp.usage.prompt_tokens == expect.num_prompt_tokens


def test_chat_stream_chunks_role_text_finish_usage(client, offline):
    expect = offline.generate([MESSAGES], greedy(12))[0]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expect.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == expect.num_prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_with_text_and_with_token_ids(client, offline):
    prompt = "The quick brown fox"
    ids = offline.tokenizer.encode(prompt)
    expect = offline.generate([prompt], greedy(8))[0]
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    for resp in (by_text, by_ids):
        assert resp.object == "text_completion"
        assert resp.choices[0].text == expect.text
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 8


def test_chat_logprobs_are_the_engines_in_openais_form(client, offline):
    out = offline.generate([MESSAGES], greedy(10, logprobs=3))[0]
    records = _engine_records(offline, MESSAGES, greedy(10, logprobs=3))
    args = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(logprobs=True, top_logprobs=3, **args)
    content = resp.choices[0].logprobs.content
    assert resp.choices[0].message.content == out.text and len(content) == resp.usage.completion_tokens == 10
    for got, want in zip(content, records):
        assert got.token == want["token"] and got.bytes == list(want["token"].encode())
        assert got.logprob == pytest.approx(want["logprob"], abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t["token"] for t in want["top"]]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t["logprob"] for t in want["top"]], abs=1e-4)
    streamed = [e for c in client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **args)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**args)
    assert plain.choices[0].logprobs is None
    bare = client.chat.completions.create(logprobs=True, **args).choices[0].logprobs.content
    assert len(bare) == 10 and all(e.top_logprobs == [] for e in bare)


def test_completion_logprobs_in_the_legacy_form(client, offline):
    prompt = "The quick brown fox"
    records = _engine_records(offline, prompt, greedy(8, logprobs=2))
    args = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    choice = client.completions.create(**args).choices[0]
    lp = choice.logprobs
    assert lp.tokens == [r["token"] for r in records]
    assert lp.token_logprobs == pytest.approx([r["logprob"] for r in records], abs=1e-4)
    for top, r in zip(lp.top_logprobs, records):
        # the two alternatives and the sampled token (here the first alternative: greedy)
        assert set(top) == {t["token"] for t in r["top"]} | {r["token"]} and len(top) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(o <= len(choice.text) for o in lp.text_offset)
    chunks = list(client.completions.create(stream=True, **args))
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_penalties_and_logit_bias_reach_the_engine(client, offline):
    args = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    forced = client.completions.create(logit_bias={"77": 100}, logprobs=0, extra_body={"ignore_eos": True}, **args)
    assert forced.choices[0].logprobs.tokens == [offline.tokenizer.token_text(77)] * 8
    pen = dict(presence_penalty=0.5, frequency_penalty=1.0, extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    expect = offline.generate(["The quick brown fox"], greedy(8, presence_penalty=0.5, frequency_penalty=1.0,
                                                              repetition_penalty=1.5))[0]
    assert client.completions.create(**pen, **args).choices[0].text == expect.text


def _engine_records(engine, prompt, params) -> list[dict]:
    rid = f"records-{engine.num_steps}"
    if isinstance(prompt, list):
        engine.add_request(rid, None, params, messages=prompt)
    else:
        engine.add_request(rid, prompt, params)
    records = []
    while engine.has_unfinished_requests():
        records += [r for out in engine.step() for r in out.logprobs or ()]
    return records


def test_fields_asking_for_nothing_unsupported_are_accepted(raw):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for path, body in ((CHAT, _chat(tools=[tool], tool_choice="none", response_format={"type": "text"})),
                       (CHAT, _chat(tools=[], tool_choice="auto")),
                       (COMPLETIONS, _completion(echo=False, best_of=1, suffix=""))):
        resp = raw.post(path, content=body)
        assert resp.status_code == 200, resp.text


def test_completion_default_max_tokens_is_openais_16(client):
    resp = client.completions.create(model=MODEL, prompt="hello", temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


def test_completion_stream_equals_non_streaming(client):
    args = dict(model=MODEL, prompt="def main():", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_repeated_long_prompt_is_served_from_prefix_cache(client):
    prompt = "Zebra-unique " + "experts route every token to a few small networks. " * 5
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 40
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def _token_aligned_stop(tokenizer, ids: list[int]) -> tuple[str, str]:
    """(stop string, text before it): the text of one output token, first seen where that token starts."""
    full = tokenizer.decode(ids)
    for j in range(1, len(ids)):
        before, through = tokenizer.decode(ids[:j]), tokenizer.decode(ids[:j + 1])
        piece = through[len(before):]
        if piece.strip() and "\ufffd" not in through and full.find(piece) == len(before):
            return piece, before
    raise AssertionError(f"no usable stop string in {full!r}")


def test_stop_string_cuts_the_text(client, offline):
    prompt = "Numbers 0 1 2 3"
    out = offline.generate([prompt], greedy(16))[0]
    stop, before = _token_aligned_stop(offline.tokenizer, out.output_token_ids)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      stop=stop, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == before
    assert resp.choices[0].finish_reason == "stop"


def test_stop_string_spanning_tokens_is_cut_too(client, offline):
    prompt = "Numbers 0 1 2 3"
    full = offline.generate([prompt], greedy(16))[0].text
    # a two-character stop string whose first occurrence starts inside the text
    cut = next(k for k in range(3, len(full) - 2) if full.find(full[k:k + 2]) == k)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      stop=[full[cut:cut + 2]], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == full[:cut]


def test_concurrent_requests_each_get_their_own_answer(served, offline):
    prompts = ["hello", "The quick brown fox", "import torch"]
    expect = [o.text for o in offline.generate(prompts, greedy(6))]

    async def main():
        async with openai.AsyncOpenAI(api_key=API_KEY, base_url=served.url + "/v1", max_retries=0) as c:
            return await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}) for p in prompts))
    results = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.choices[0].text for r in results] == expect


def test_models_and_health(client, raw):
    assert [m.id for m in client.models.list()] == [MODEL]
    health = raw.get("/health", headers={"Authorization": ""})  # probes carry no key
    assert health.status_code == 200 and health.json()["status"] == "ok"


# --- bad input -----------------------------------------------------------------------------

def _deep_schema(objects: int) -> dict:
    schema = {"type": "string"}
    for _ in range(objects):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _chat(**fields):
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _completion(**fields):
    return json.dumps({"model": MODEL, "prompt": "hi", **fields}).encode()


BAD_REQUESTS = {
    "malformed json": ("POST", CHAT, b'{"model": ', 400, None),
    "body is an array": ("POST", CHAT, b"[1, 2]", 400, None),
    "body is a string": ("POST", COMPLETIONS, b'"hello"', 400, None),
    "NaN literal": ("POST", CHAT, _chat()[:-1] + b', "temperature": NaN}', 400, None),
    "invalid utf-8": ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    "lone surrogate": ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    "messages not a list": ("POST", CHAT, json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    "content a number": ("POST", CHAT, json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
                         400, "messages"),
    "max_tokens a string": ("POST", CHAT, _chat(max_tokens="5"), 400, "max_tokens"),
    "max_tokens a float": ("POST", COMPLETIONS, _completion(max_tokens=2.5), 400, "max_tokens"),
    "temperature a string": ("POST", CHAT, _chat(temperature="hot"), 400, "temperature"),
    "stream a string": ("POST", CHAT, _chat(stream="yes"), 400, "stream"),
    "missing messages": ("POST", CHAT, json.dumps({"model": MODEL}).encode(), 400, "messages"),
    "missing prompt": ("POST", COMPLETIONS, json.dumps({"model": MODEL}).encode(), 400, "prompt"),
    "empty messages": ("POST", CHAT, _chat(messages=[]), 400, "messages"),
    "function role": ("POST", CHAT, _chat(messages=[{"role": "function", "content": "x"}]), 400, "messages"),
    "image part": ("POST", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages"),
    "two prompts": ("POST", COMPLETIONS, _completion(prompt=["a", "b"]), 400, "prompt"),
    "empty prompt": ("POST", COMPLETIONS, _completion(prompt=[]), 400, None),
    "token id outside vocab": ("POST", COMPLETIONS, _completion(prompt=[10**6]), 400, None),
    "max_tokens zero": ("POST", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": ("POST", COMPLETIONS, _completion(max_tokens=-3), 400, "max_tokens"),
    "max_tokens over context": ("POST", CHAT, _chat(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    "temperature negative": ("POST", CHAT, _chat(temperature=-1), 400, "temperature"),
    "top_p zero": ("POST", CHAT, _chat(top_p=0), 400, "top_p"),
    "top_k negative": ("POST", COMPLETIONS, _completion(top_k=-5), 400, "top_k"),
    "n of zero": ("POST", CHAT, _chat(n=0), 400, "n"),
    "n over 64": ("POST", COMPLETIONS, _completion(n=65), 400, "n"),
    "empty stop string": ("POST", CHAT, _chat(stop=[""]), 400, "stop"),
    "seed too large": ("POST", CHAT, _chat(seed=2**64), 400, "seed"),
    "top_logprobs without logprobs": ("POST", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs over 20": ("POST", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "top_logprobs negative": ("POST", CHAT, _chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    "chat logprobs a number": ("POST", CHAT, _chat(logprobs=3), 400, "logprobs"),
    "completion logprobs over 20": ("POST", COMPLETIONS, _completion(logprobs=21), 400, "logprobs"),
    "completion logprobs a boolean": ("POST", COMPLETIONS, _completion(logprobs=True), 400, "logprobs"),
    "presence_penalty over 2": ("POST", CHAT, _chat(presence_penalty=2.5), 400, "presence_penalty"),
    "frequency_penalty a string": ("POST", COMPLETIONS, _completion(frequency_penalty="1"), 400, "frequency_penalty"),
    "repetition_penalty zero": ("POST", CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty"),
    "min_tokens over max_tokens": ("POST", CHAT, _chat(min_tokens=9, max_tokens=8), 400, "min_tokens"),
    "min_tokens negative": ("POST", COMPLETIONS, _completion(min_tokens=-1), 400, "min_tokens"),
    "logit_bias key not an id": ("POST", CHAT, _chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    "logit_bias key negative": ("POST", COMPLETIONS, _completion(logit_bias={"-5": 1}), 400, "logit_bias"),
    "logit_bias value over 100": ("POST", CHAT, _chat(logit_bias={"5": 101}), 400, "logit_bias"),
    "logit_bias a list": ("POST", CHAT, _chat(logit_bias=[5]), 400, "logit_bias"),
    "logit_bias outside the vocabulary": ("POST", COMPLETIONS, _completion(logit_bias={"99999999": 1}), 400, None),
    "tool of another type": ("POST", CHAT, _chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400,
                             "tools"),
    "tool without a function": ("POST", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools"),
    "tool function without a name": ("POST", CHAT, _chat(tools=[{"type": "function", "function": {}}]), 400, "tools"),
    "tool call arguments not a string": ("POST", CHAT, _chat(messages=[{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]), 400, "messages"),
    "tool_choice required without tools": ("POST", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    "tool_choice a number": ("POST", CHAT, _chat(tool_choice=3), 400, "tool_choice"),
    "response_format of type json_schema without one": ("POST", CHAT, _chat(response_format={"type": "json_schema"}),
                                                         400, "response_format"),
    "response_format schema nested 140 levels": ("POST", CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "deep", "schema": _deep_schema(70)}}), 400, "response_format"),
    "chat_template_kwargs a list": ("POST", CHAT, _chat(chat_template_kwargs=["thinking"]), 400,
                                    "chat_template_kwargs"),
    "chat_template_kwargs setting tools": ("POST", CHAT, _chat(chat_template_kwargs={"tools": []}), 400,
                                           "chat_template_kwargs"),
    "chat_template_kwargs key not a name": ("POST", CHAT, _chat(chat_template_kwargs={"a-b": 1}), 400,
                                            "chat_template_kwargs"),
    "best_of two": ("POST", COMPLETIONS, _completion(best_of=2), 400, "best_of"),
    "suffix with echo": ("POST", COMPLETIONS, _completion(suffix="end", echo=True), 400, "suffix"),
    "suffix after token ids": ("POST", COMPLETIONS, _completion(prompt=[5, 6], suffix="end"), 400, "suffix"),
    "unknown model": ("POST", CHAT, _chat(model="gpt-4o"), 404, "model"),
    "unknown route": ("POST", "/v1/embeddings", _chat(), 404, None),
    "unknown path": ("GET", "/nowhere", None, 404, None),
    "wrong method": ("GET", CHAT, None, 405, None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_openai_error(raw, case):
    method, path, body, status, param = BAD_REQUESTS[case]
    resp = raw.request(method, path, content=body)
    assert resp.status_code == status, resp.text
    error = _assert_openai_error(resp)
    if param is not None:
        assert error["param"] == param
    if case == "unknown model":
        assert error["code"] == "model_not_found"
    if case == "max_tokens over context":
        assert error["code"] == "context_length_exceeded"


def _assert_openai_error(resp) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, _completion(prompt=[5] * MAX_MODEL_LEN)),
    (CHAT, _chat(messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}])),
    (CHAT, _chat(messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}], stream=True)),
])
def test_prompt_over_the_context_is_rejected(raw, path, body):
    resp = raw.post(path, content=body)
    assert resp.status_code == 400, resp.text
    assert _assert_openai_error(resp)["code"] == "context_length_exceeded"


def test_oversized_body_is_413_by_length_and_while_reading(raw):
    padding = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
    declared = raw.post(CHAT, content=padding)
    chunked = raw.post(CHAT, content=iter([padding[:1000], padding[1000:]]))  # no Content-Length
    for resp in (declared, chunked):
        assert resp.status_code == 413
        _assert_openai_error(resp)


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", f"Basic {API_KEY}"])
def test_api_key_is_required(served, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = httpx.post(served.url + CHAT, content=_chat(), headers=headers, timeout=30)
    assert resp.status_code == 401
    assert _assert_openai_error(resp)["code"] == "invalid_api_key"


def test_max_tokens_limit(served):
    app = build_http_app(served.backend, max_tokens_limit=32)

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            return await c.post(CHAT, content=_chat(max_tokens=33))
    resp = asyncio.run(main())
    assert resp.status_code == 400 and _assert_openai_error(resp)["param"] == "max_tokens"


def test_server_still_serves_after_bad_input(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert resp.usage.completion_tokens <= 3 and resp.choices[0].finish_reason in ("stop", "length")


# --- sessions and disconnects --------------------------------------------------------------

def test_session_id_from_header_then_user_then_extension():
    body = {"user": "u-1", "session_id": "s-1"}
    assert pick_session_id(Headers({"x-session-id": "h-1"}), body, "x-session-id") == "h-1"
    assert pick_session_id(Headers({"x-other": "h-1"}), body, "x-session-id") == "u-1"
    assert pick_session_id(Headers({}), {"session_id": "s-1"}, "x-session-id") == "s-1"
    assert pick_session_id(Headers({}), {}, "x-session-id") is None


def _wait_until_idle(engine, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy after the client left: {stats}"
        time.sleep(0.05)


LONG_ANSWER = MAX_MODEL_LEN - 30


def _assert_aborted_early(engine, steps_at_disconnect: int) -> None:
    """Idle and blocks freed, long before the answer could have run to its end on its own."""
    stats = _wait_until_idle(engine)
    assert stats["steps"] - steps_at_disconnect < LONG_ANSWER // 2, stats


def test_stream_disconnect_aborts_the_request(served, raw):
    _disconnect_mid_stream(served, raw, _chat(stream=True, max_tokens=LONG_ANSWER, temperature=0, ignore_eos=True))


def _disconnect_mid_stream(served, raw, body: bytes, events: int = 4, running: int = 1) -> None:
    """Reads `events` events of a streamed chat, checks `running` requests run, leaves, and
    checks they were all aborted early."""
    _wait_until_idle(served.engine)
    with raw.stream("POST", CHAT, content=body) as resp:
        assert resp.status_code == 200
        # hold the line iterator: dropping it early would close the connection before the check below
        lines = resp.iter_lines()
        seen = 0
        while seen < events:
            seen += next(lines).startswith("data: ")
        stats = served.engine.stats()
        assert stats["running"] == running, stats
    _assert_aborted_early(served.engine, steps_at_disconnect=stats["steps"])


def test_non_streaming_disconnect_aborts_the_request(served):
    _wait_until_idle(served.engine)
    body = _chat(max_tokens=LONG_ANSWER, temperature=0, ignore_eos=True)
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 15
        while (stats := served.engine.stats())["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    _assert_aborted_early(served.engine, steps_at_disconnect=stats["steps"])


# --- server faults -------------------------------------------------------------------------

def _fail_engine_steps_after(monkeypatch, served, good_steps: int) -> None:
    """Makes the engine's forward pass fail once `good_steps` steps have run, as a GPU fault would."""
    runner = served.engine.engine.runner
    real_run, calls = runner.run, itertools.count()

    def run(batch):
        if next(calls) >= good_steps:
            raise RuntimeError("injected step failure")
        return real_run(batch)
    monkeypatch.setattr(runner, "run", run)


def test_engine_failure_mid_stream_ends_with_error_event(served, raw, monkeypatch):
    _wait_until_idle(served.engine)
    _fail_engine_steps_after(monkeypatch, served, good_steps=4)
    with raw.stream("POST", CHAT, content=_chat(stream=True, max_tokens=50, ignore_eos=True)) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected step failure" in error["message"]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    # no regular finish before the error: the client must not take the cut-off text as complete
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in events[:-2])
    _wait_until_idle(served.engine)


def test_engine_failure_before_any_output_is_500(served, raw, monkeypatch):
    _wait_until_idle(served.engine)
    _fail_engine_steps_after(monkeypatch, served, good_steps=0)
    for streaming in (False, True):
        resp = raw.post(CHAT, content=_chat(stream=streaming))
        assert resp.status_code == 500
        assert _assert_openai_error(resp)["type"] == "server_error"
    monkeypatch.undo()
    _wait_until_idle(served.engine)
    assert raw.post(CHAT, content=_chat(max_tokens=2)).status_code == 200


def test_overload_and_unexpected_backend_errors_map_to_5xx():
    overloaded = api_error_from(Overloaded("all decode ranks are full", retry_after_s=2.4))
    assert (overloaded.status, overloaded.headers["Retry-After"], overloaded.code) == (503, "2", "overloaded")
    crashed = api_error_from(KeyError("rank 3"))
    assert crashed.status == 500 and crashed.type == "server_error" and "rank 3" not in crashed.message


def test_min_tokens_over_http(client, offline):
    """vLLM's min_tokens: the end-of-sequence token (forced here by a bias) waits for it."""
    eos = str(offline.eos_token_id)
    early = client.completions.create(model=MODEL, prompt="hello", max_tokens=10, temperature=0, logit_bias={eos: 100})
    held = client.completions.create(model=MODEL, prompt="hello", max_tokens=10, temperature=0, logit_bias={eos: 100},
                                     extra_body={"min_tokens": 4})
    assert early.usage.completion_tokens == 1 and held.usage.completion_tokens == 5
    assert held.choices[0].finish_reason == "stop"
