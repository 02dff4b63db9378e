"""Tool calls: DeepSeek's markers in the chat template, the calls found in an answer whole and as
it streams, and the API's response and stream shapes (checked against the OpenAPI document)."""
import asyncio
import json
import random

import jsonschema
import pytest

from app.openapi import openapi_spec
from app.service import OpenAIService
from app.tool_calls import ToolCallStream, split_tool_calls
from engine.sampling import SamplingParams
from engine.tokenizer import (CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END, OUTPUT_BEGIN, TOOL_MARKERS,
                              Tokenizer)
from tests.test_http_api import MODEL, client, offline, served  # noqa: F401

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather at a place.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def _calls(*calls, v3=False) -> str:
    if v3:
        body = "".join(f"{CALL_BEGIN}function{CALL_SEP}{n}\n```json\n{a}\n```{CALL_END}" for n, a in calls)
    else:
        body = "".join(f"{CALL_BEGIN}{n}{CALL_SEP}{a}{CALL_END}" for n, a in calls)
    return CALLS_BEGIN + body + CALLS_END


@pytest.mark.parametrize("v3", [False, True])
def test_calls_are_split_from_the_content_in_both_forms(v3):
    text = "Let me look. " + _calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"), v3=v3)
    content, calls = split_tool_calls(text)
    assert content == "Let me look. "
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]


@pytest.mark.parametrize("text, content, names", [
    ("no calls at all <｜not a marker", "no calls at all <｜not a marker", []),
    ("held < back", "held < back", []),
    ("cut " + CALLS_BEGIN + CALL_BEGIN + "get_weather" + CALL_SEP + '{"ci', "cut ", ["get_weather"]),  # ran out
    (CALLS_BEGIN + CALL_BEGIN + CALL_SEP + "{}" + CALL_END + CALL_BEGIN + "g" + CALL_SEP + "{}", "", ["g"]),
    (CALLS_BEGIN + CALL_BEGIN + "no separator" + CALL_END + CALL_BEGIN + "f" + CALL_SEP + "{}" + CALL_END, "", ["f"]),
])
def test_odd_answers(text, content, names):
    got, calls = split_tool_calls(text)
    assert got == content and [c["name"] for c in calls] == names


def _assemble(deltas: list[dict]) -> list[dict]:
    """A stream's tool-call pieces put together as {"name", "arguments"}, checking their shape."""
    calls = []
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(calls) and d["type"] == "function" and d["id"].startswith("call_")
            calls.append({"name": d["function"]["name"], "arguments": d["function"]["arguments"]})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} and d["function"]["arguments"]
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls


@pytest.mark.parametrize("v3", [False, True])
def test_a_stream_cut_anywhere_gives_the_whole_answers_result(v3):
    """Cut at random places (or every character), the stream's content and call pieces add up to
    the whole answer's; the arguments go out in pieces before their call ends."""
    args = '{"city": "Paris", "note": "a `b` c"}'
    text = "Sure: " + _calls(("get_weather", args), ("f", "{}"), v3=v3)
    want = split_tool_calls(text)
    assert want == ("Sure: ", [{"name": "get_weather", "arguments": args}, {"name": "f", "arguments": "{}"}])
    rng = random.Random(0)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30))) if trial else list(range(1, len(text)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream, content, deltas = ToolCallStream(), "", []
        for piece in pieces:
            c, done = stream.feed(piece)
            content, deltas = content + c, deltas + done
            # content is never a marker's start: it goes out as soon as it is known not to be one
            assert CALLS_BEGIN[:2] not in content
        rest, more = stream.finish()
        content += rest
        assert (content, _assemble(deltas + more)) == want and stream.num_calls == 2
        if not trial:  # a character at a time: the first call's arguments came in many pieces
            assert len([d for d in deltas if d["index"] == 0]) > 10


def test_markers_are_single_tokens_that_decode_as_text(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    for marker in TOOL_MARKERS:
        (token,) = tok.encode(marker)
        assert tok.decode([token]) == marker == tok.token_text(token)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tok.decode(tok.apply_chat_template(messages, tools=[WEATHER]))
    assert "### get_weather" in text and '"city"' in text
    assert _calls(("get_weather", '{"city": "Paris"}')) in text and OUTPUT_BEGIN + "sunny" in text
    assert "get_weather" not in tok.decode(tok.apply_chat_template(messages[:1]))


class ScriptedBackend:
    """Answers every request with the same text, a few characters per output."""
    model_name, max_model_len = "scripted", 4096

    def __init__(self, text: str, finish_reason: str = "stop"):
        self.text, self.finish_reason, self.requests = text, finish_reason, []

    async def generate(self, request, session_id):
        self.requests.append(request)
        pieces = [self.text[i:i + 5] for i in range(0, len(self.text), 5)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield {"text_delta": piece, "new_token_ids": [1], "finished": last,
                   "finish_reason": self.finish_reason if last else None, "num_prompt_tokens": 7, "num_cached_tokens": 0}

    async def health(self):
        return {}


def _schema(name):
    spec = openapi_spec("scripted")
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


def _respond(backend, body, stream=False, reasoning_parser=None):
    service = OpenAIService(backend, reasoning_parser=reasoning_parser)

    async def run():
        req, engine_request = service.parse("chat", dict(body, stream=stream))
        outputs, firsts = await service.open("chat", engine_request, None)
        if stream:
            return [c async for c in service.chunks("chat", req, engine_request, outputs, firsts)]
        return await service.collect("chat", req, engine_request, outputs, firsts)
    return asyncio.run(run())


BODY = {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "tools": [WEATHER]}


def test_the_answers_calls_come_back_as_tool_calls():
    backend = ScriptedBackend("Checking. " + _calls(("get_weather", '{"city": "Paris"}'),
                                                    ("get_weather", '{"city": "Rome"}')))
    resp = _respond(backend, BODY)
    _schema("ChatCompletion").validate(resp)
    (choice,) = resp["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking. "
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert backend.requests[0]["tools"] == [WEATHER]

    chunks = _respond(backend, BODY, stream=True)
    chunk_schema = _schema("ChatCompletionChunk")
    for c in chunks:
        chunk_schema.validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    streamed = _assemble([call for d in deltas for call in d.get("tool_calls", ())])
    assert streamed == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_or_with_tool_choice_none_the_text_is_content():
    text = "Plain " + _calls(("get_weather", "{}"))
    for body in ({"messages": BODY["messages"]}, dict(BODY, tool_choice="none")):
        backend = ScriptedBackend(text)
        resp = _respond(backend, body)
        assert resp["choices"][0]["message"] == {"role": "assistant", "content": text}
        assert resp["choices"][0]["finish_reason"] == "stop" and backend.requests[0]["tools"] is None


def test_a_call_cut_by_the_length_limit_keeps_what_was_written():
    """As OpenAI's: the call's name and the arguments so far, with finish_reason "length"."""
    backend = ScriptedBackend("Let me " + CALLS_BEGIN + CALL_BEGIN + "get_weather" + CALL_SEP + '{"ci', "length")
    resp = _respond(backend, BODY)
    message = resp["choices"][0]["message"]
    assert message["content"] == "Let me " and resp["choices"][0]["finish_reason"] == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"ci')]
    chunks = _respond(backend, BODY, stream=True)
    pieces = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", ())]
    assert _assemble(pieces) == [{"name": "get_weather", "arguments": '{"ci'}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_conversation_with_tools_reaches_the_engine(client, offline):
    """Tools, an assistant's earlier call and the tool's answer go through the chat template."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    engine_messages = [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]},
                       {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    offline.add_request("tools", None, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                        messages=engine_messages, tools=[WEATHER])
    want = None
    while offline.has_unfinished_requests():
        want = next((o for o in offline.step() if o.request_id == "tools"), want)
    resp = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == len(offline.tokenizer.apply_chat_template(engine_messages, tools=[WEATHER]))
    assert resp.choices[0].message.content == want.text
    plain = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=1)
    assert plain.usage.prompt_tokens == len(offline.tokenizer.apply_chat_template(engine_messages))
