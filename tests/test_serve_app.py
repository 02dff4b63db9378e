"""The Serve application end to end: real local Ray, real NIXL between processes, the real
openai client over HTTP, Python handles."""
import asyncio
import json
import re
import socket
import uuid

import pytest
import ray
from ray import serve

from app.main import build_app
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.tokenizer import THINK_END, Tokenizer

openai = pytest.importorskip("openai")

ENGINE = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_ckpt, tmp_path_factory):
    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             logging_level="ERROR", runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": {"path": str(tiny_ckpt), "name": "tiny", "reasoning_parser": "deepseek_v3"}, "engine": ENGINE,
                "prefill": {"replicas": 2}, "decode": {"dp_size": 2},
                "kv_transport": {"backend": "nixl", "local_prefill_max_tokens": 0, "timeout_s": 20},
                "routing": {"max_running_per_rank": 4}, "eplb": {"enabled": False}}
        serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield client, port
    finally:
        serve.shutdown()
        ray.shutdown()


def _decode_stats():
    return serve.get_deployment_handle("DecodeGroup", app_name="wideep").stats.remote().result()


def _messages(text):
    return [{"role": "user", "content": text}]


def test_non_streaming_and_streaming_chat(served):
    client, _ = served
    r = client.chat.completions.create(model="tiny", messages=_messages("hello there"), max_tokens=6,
                                       temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    pieces = []
    for chunk in client.chat.completions.create(model="tiny", messages=_messages("hello there"), max_tokens=6,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == r.choices[0].message.content


def test_thinking_through_the_application(served, tiny_ckpt):
    """The deployment's reasoning parser (deepseek_v3) and chat_template_kwargs reach the ingress and
    the decode rank's template: with thinking on, the answer opens inside its reasoning."""
    client, _ = served
    r = client.chat.completions.create(model="tiny", messages=_messages("hello there"), max_tokens=6, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}, "ignore_eos": True})
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    prompt = alone.tokenizer.apply_chat_template(_messages("hello there"), template_kwargs={"thinking": True})
    expect = alone.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    message = r.choices[0].message.model_dump()
    assert r.usage.prompt_tokens == len(prompt)
    if THINK_END in expect.text:
        reasoning, content = expect.text.split(THINK_END, 1)
    else:
        reasoning, content = expect.text, ""
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)


def test_echo_scores_the_prompt_on_the_decode_rank(served, tiny_ckpt):
    """Prompt logprobs need every prompt position's logits, which a prefill server does not send:
    the prompt is computed on the decode rank, and the records are the engine's."""
    client, _ = served
    before = sum(s["prefill_remote"] for s in _decode_stats())
    text = "Experts are small feed-forward networks; a router picks a few of them for every token."
    r = client.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True)
    assert sum(s["prefill_remote"] for s in _decode_stats()) == before
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    ids = alone.tokenizer.encode(text)
    expect = alone.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(text) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([rec["logprob"] for rec in expect.prompt_logprobs[1:]],
                                                          abs=1e-5)


def test_pd_output_equals_decode_rank_alone(served, tiny_ckpt):
    client, _ = served
    before = sum(s["prefill_remote"] for s in _decode_stats())
    text = "The key value cache keeps what attention has already seen. " * 6
    r = client.chat.completions.create(model="tiny", messages=_messages(text), max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    stats = _decode_stats()
    assert sum(s["prefill_remote"] for s in stats) == before + 1
    assert sum(s["kv_bytes_received"] for s in stats) > 0
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    expect = alone.generate([_messages(text)], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert r.choices[0].message.content == expect.text


def test_pd_carries_the_first_tokens_logprobs(served, tiny_ckpt):
    """The prefill server samples the first token; its logprobs travel back with it."""
    client, _ = served
    before = sum(s["prefill_remote"] for s in _decode_stats())
    text = "Log-probabilities say how sure the model was of each token. " * 6
    r = client.chat.completions.create(model="tiny", messages=_messages(text), max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert sum(s["prefill_remote"] for s in _decode_stats()) == before + 1
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    alone.add_request("alone", None, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2),
                      messages=_messages(text))
    want = []
    while alone.has_unfinished_requests():
        want += [rec for out in alone.step() for rec in out.logprobs or ()]
    got = r.choices[0].logprobs.content
    assert [e.token for e in got] == [w["token"] for w in want] and len(got) == 5
    assert [e.logprob for e in got] == pytest.approx([w["logprob"] for w in want], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t["token"] for t in w["top"]] for w in want]
    # the first token's logit bias is applied where it is sampled, on the prefill server
    forced = client.chat.completions.create(model="tiny", messages=_messages("Forced. " + text), max_tokens=3,
                                            temperature=0, logprobs=True, logit_bias={"77": 100},
                                            extra_body={"ignore_eos": True})
    assert sum(s["prefill_remote"] for s in _decode_stats()) == before + 2
    assert [e.token for e in forced.choices[0].logprobs.content] == [alone.tokenizer.token_text(77)] * 3


def test_pd_samples_the_first_token_under_the_grammar(served, tiny_ckpt):
    """A structured answer prefilled remotely: the prefill server's first token follows the grammar
    too, and the answer is the decode rank's alone (greedy)."""
    client, _ = served
    before = sum(s["prefill_remote"] for s in _decode_stats())
    text = "Answer with a code of three digits and two letters. " * 5
    regex = r"[0-9]{3}-[a-c]{2}"
    r = client.chat.completions.create(model="tiny", messages=_messages(text), max_tokens=16, temperature=0,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert sum(s["prefill_remote"] for s in _decode_stats()) == before + 1
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    expect = alone.generate([_messages(text)], SamplingParams(max_tokens=16, temperature=0, structured_output={
        "kind": "regex", "value": regex}))[0]
    assert r.choices[0].message.content == expect.text and r.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, expect.text)


def test_pd_holds_the_end_back_for_min_tokens(served, tiny_ckpt):
    """The prefill server samples the first token: min_tokens holds the end-of-sequence token back
    there too."""
    client, _ = served
    tok = Tokenizer(tiny_ckpt)
    eos = tok.eos_token_id
    before = sum(s["prefill_remote"] for s in _decode_stats())
    text = "An answer that may not end at once. " * 6
    r = client.chat.completions.create(model="tiny", messages=_messages(text), max_tokens=10, temperature=0,
                                       logprobs=True, logit_bias={str(eos): 100}, extra_body={"min_tokens": 3})
    assert sum(s["prefill_remote"] for s in _decode_stats()) == before + 1
    tokens = [e.token for e in r.choices[0].logprobs.content]
    assert len(tokens) == 4 and tokens[-1] == tok.token_text(eos) and tok.token_text(eos) not in tokens[:3]
    assert r.choices[0].finish_reason == "stop"


def test_a_forced_call_after_thinking(served, tiny_ckpt):
    """With thinking on, the grammar applies after </think>: the reasoning is free and the call's
    arguments follow the tool's schema."""
    client, _ = served
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}}}
    (end,) = Tokenizer(tiny_ckpt).encode(THINK_END)
    r = client.chat.completions.create(
        model="tiny", messages=_messages("pick one"), max_tokens=160, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "pick"}}, logit_bias={str(end): 100},
        extra_body={"chat_template_kwargs": {"thinking": True}})
    message = r.choices[0].message
    assert message.reasoning_content == "" and r.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.function.name == "pick" and json.loads(call.function.arguments)["n"] in (1, 2, 3)
    assert r.usage.completion_tokens_details.reasoning_tokens == 1  # the marker, forced by the bias


def test_tokenize_through_the_group(served, tiny_ckpt):
    """/tokenize and /detokenize over HTTP and through the Python handle: a rank's engine makes the
    ids, as a request's would be made; bad input is still a 400."""
    import httpx2 as httpx
    client, port = served
    tok = Tokenizer(tiny_ckpt)
    messages = _messages("how many tokens is this?")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        got = http.post("/tokenize", json={"messages": messages, "chat_template_kwargs": {"thinking": True}}).json()
        assert got["tokens"] == tok.apply_chat_template(messages, template_kwargs={"thinking": True})
        assert http.post("/detokenize", json={"tokens": got["tokens"]}).json()["prompt"] == tok.hf.decode(got["tokens"])
        bad = http.post("/detokenize", json={"tokens": [10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    handle = serve.get_app_handle("wideep")
    assert handle.tokenize.remote({"prompt": "hello"}).result()["tokens"] == tok.encode("hello")
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.apply_chat_template(messages))


def test_second_turn_hits_prefix_cache(served):
    client, _ = served
    session = f"s-{uuid.uuid4().hex[:6]}"
    history = _messages("Experts are small feed-forward networks; a router picks a few of them. " * 4)
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                           extra_headers={"x-session-id": session})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0,
                                            extra_headers={"x-session-id": session})
    cached = second.usage.prompt_tokens_details.cached_tokens
    # every full block of turn one's prompt is reused on the session's rank
    assert cached >= (first.usage.prompt_tokens // 4) * 4 - 4 and cached > 0


def test_sessions_stay_sticky_under_load(served):
    group = serve.get_deployment_handle("DecodeGroup", app_name="wideep").options(stream=True)
    sessions = [f"sticky-{i}-{uuid.uuid4().hex[:4]}" for i in range(2)]
    hits_before = sum(s["prefill_side_hit_tokens"] for s in _decode_stats())

    async def turn(session, t, prompt):
        req = {"request_id": f"{session}-{t}", "prompt_token_ids": prompt,
               "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True}}
        ranks, tokens = set(), []
        async for out in group.generate.remote(req, session_id=session):
            ranks.add(out["rank"])
            tokens += out["new_token_ids"]
        return ranks, tokens

    async def session_run(i, session):
        prompt, seen = list(range(10 + i, 50 + i)), set()
        for t in range(3):
            ranks, tokens = await turn(session, t, prompt)
            seen |= ranks
            prompt = prompt + tokens + list(range(60, 70))
        return seen

    async def main():
        return await asyncio.gather(*(session_run(i, s) for i, s in enumerate(sessions)))
    seen = asyncio.run(main())
    assert all(len(ranks) == 1 for ranks in seen)      # each session kept one decode rank
    assert seen[0] != seen[1]                            # and the two were spread over the ranks
    # Turns 2 and 3 of each session found their prefix on the prefill replica of turn 1.
    gained = sum(s["prefill_side_hit_tokens"] for s in _decode_stats()) - hits_before
    assert gained >= 2 * 2 * 40


def test_python_handle_api(served):
    handle = serve.get_app_handle("wideep")
    req = {"model": "tiny", "messages": _messages("hello from an agent"), "max_tokens": 5, "temperature": 0}
    reply = handle.chat.remote(req, session_id="agent-1").result()
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 5
    chunks = list(handle.options(stream=True).chat_stream.remote(req, session_id="agent-1"))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == reply["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    done = handle.completions.remote({"prompt": [5, 6, 7, 8], "max_tokens": 3}).result()
    assert done["object"] == "text_completion" and done["usage"]["prompt_tokens"] == 4
    # choices through the decode group, on the session's rank, with the same prompt cache
    many = handle.chat.remote(dict(req, n=3, temperature=1.0, seed=5), session_id="agent-1").result()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2] and many["usage"]["completion_tokens"] == 15
    streamed = list(handle.options(stream=True).chat_stream.remote(dict(req, n=3, temperature=1.0, seed=5),
                                                                   session_id="agent-1"))
    for c in many["choices"]:
        assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in streamed
                       if ch["choices"] and ch["choices"][0]["index"] == c["index"]) == c["message"]["content"]
    from app.openai_api import APIError
    with pytest.raises(APIError) as bad:
        handle.chat.remote({"messages": [], "max_tokens": 3}).result()
    assert bad.value.status == 400


def test_bad_input_over_http_gets_openai_errors(served):
    import httpx2 as httpx
    _, port = served
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    too_long = "x " * 5000  # far over the 1024-token context of this config
    cases = [
        (b"{not json", 400, None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}', 404, "model_not_found"),
        (('{"messages": [{"role": "user", "content": "%s"}], "max_tokens": 4}' % too_long).encode(), 400,
         "context_length_exceeded"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "max_tokens": 99999}', 400, None),
    ]
    for body, status, code in cases:
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body[:60], r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
        if code:
            assert err["code"] == code
    ok = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
    # a grammar that does not compile, found by a rank's engine: a 400 naming the field that asked
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "nope"}}}}, "response_format"), ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs")):
        r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_client_disconnect_mid_stream_aborts_everywhere(served):
    import time

    import httpx2 as httpx
    _, port = served
    body = {"model": "tiny", "prompt": list(range(5, 200)), "max_tokens": 500, "ignore_eos": True, "stream": True}
    steps_before = max(s["steps"] for s in _decode_stats())
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break  # the client goes away mid-stream
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = _decode_stats()
        if all(s["running"] == 0 and s["kv_blocks_used"] == 0 for s in stats):
            break
        time.sleep(0.2)
    assert all(s["running"] == 0 and s["kv_blocks_used"] == 0 for s in stats), stats
    # nowhere near 500 tokens were produced: the request was aborted, not finished
    assert max(s["steps"] for s in stats) - steps_before < 300


def test_pools_empty_after_the_tests(served):
    time_left = 50
    while time_left:
        stats = _decode_stats()
        if all(s["running"] == 0 and s["kv_blocks_used"] == 0 and s["awaiting_kv"] == 0 for s in stats):
            break
        time_left -= 1
        import time
        time.sleep(0.2)
    assert all(s["kv_blocks_used"] == 0 for s in stats)
    prefill = serve.get_deployment_handle("PrefillServer", app_name="wideep")
    assert prefill.stats.remote().result()["held_kv"] == 0
