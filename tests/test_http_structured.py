"""Structured output over the OpenAI API: response_format (json_object, json_schema), vLLM's
structured_outputs, and forced tool calls (tool_choice "required" or a named function), whole and
streamed, checked against the OpenAPI document; and the bad forms of each, each a 400 naming it."""
import json
import re

import jsonschema
import pytest

from app.openapi import openapi_spec
from engine.tokenizer import CALLS_BEGIN, Tokenizer
# client and raw talk to this module's `served`
from tests.test_http_api import CHAT, COMPLETIONS, ENGINE_CFG, MODEL, client, raw, serving  # noqa: F401

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}
@pytest.fixture(scope="module")
def served(tiny_ckpt):
    # a longer context than test_http_api's: the template spells out each tool's schema
    with serving(tiny_ckpt, dict(ENGINE_CFG, max_model_len=1024)) as s:
        yield s


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def _schema(name):
    spec = openapi_spec(MODEL)
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


def _chat(**kw):
    return dict(dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0.8, seed=1), **kw)


def _strict(tool: dict) -> dict:
    return {"type": "function", "function": dict(tool["function"], strict=True)}


def _seeds(raw, path, body, seeds=range(4)):
    """Responses for a few seeds: the tiny model's random weights may wander past max_tokens on
    one, so checks that need a complete answer take those that stopped."""
    out = []
    for seed in seeds:
        resp = raw.post(path, json=dict(body, seed=seed))
        assert resp.status_code == 200, resp.text
        out.append(resp.json())
    return out


def test_json_schema_answers_follow_the_schema(raw):
    body = _chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                          "strict": True}})
    responses = _seeds(raw, CHAT, body)
    done = [r for r in responses if r["choices"][0]["finish_reason"] == "stop"]
    assert len(done) >= 2
    for r in responses:
        _schema("ChatCompletion").validate(r)
    for r in done:
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), PERSON)


def test_json_object_and_vllm_forms_on_both_endpoints(raw):
    for path, body, check in [
        (CHAT, _chat(response_format={"type": "json_object"}), lambda t: isinstance(json.loads(t), dict)),
        (COMPLETIONS, dict(model=MODEL, prompt="x", max_tokens=40, structured_outputs={"regex": r"[0-9]{4}"}),
         lambda t: re.fullmatch(r"[0-9]{4}", t)),
        (CHAT, _chat(structured_outputs={"choice": ["yes", "no"]}), lambda t: t in ("yes", "no")),
        (CHAT, _chat(structured_outputs={"json": PERSON}),
         lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        (COMPLETIONS, dict(model=MODEL, prompt="x", max_tokens=40,
                           structured_outputs={"grammar": 'root ::= "<" [a-c]+ ">"'}),
         lambda t: re.fullmatch(r"<[a-c]+>", t)),
    ]:
        responses = _seeds(raw, path, body)
        done = [r for r in responses if r["choices"][0]["finish_reason"] == "stop"]
        assert done, (body, responses)
        for r in done:
            c = r["choices"][0]
            text = c["message"]["content"] if path == CHAT else c["text"]
            assert check(text), (body, text)


def test_a_named_tool_choice_calls_it_with_arguments_of_its_schema(raw):
    body = _chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "clock"}})
    responses = _seeds(raw, CHAT, body)
    for r in responses:
        _schema("ChatCompletion").validate(r)
        c = r["choices"][0]
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "clock" and call["id"].startswith("call_")
        if c["finish_reason"] == "tool_calls":
            assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
            assert c["message"]["content"] is None
    assert any(r["choices"][0]["finish_reason"] == "tool_calls" for r in responses)


def test_required_calls_one_or_more_of_the_tools(raw):
    body = _chat(tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=120)
    calls = []
    for r in _seeds(raw, CHAT, body, range(6)):
        _schema("ChatCompletion").validate(r)
        c = r["choices"][0]
        if c["finish_reason"] == "tool_calls":
            assert c["message"]["tool_calls"] and c["message"]["content"] is None
            calls += c["message"]["tool_calls"]
    assert calls
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert {"weather": "city", "clock": "zone"}[call["function"]["name"]] in args
    one = _seeds(raw, CHAT, dict(body, parallel_tool_calls=False), range(6))
    assert all(len(r["choices"][0]["message"].get("tool_calls") or []) <= 1 for r in one)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_calls_streamed_equal_whole(raw, tool_choice):
    body = _chat(tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=120, seed=3)
    whole = raw.post(CHAT, json=body).json()["choices"][0]
    resp = raw.post(CHAT, json=dict(body, stream=True))
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    validator = _schema("ChatCompletionChunk")
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in chunks:
        validator.validate(chunk)
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reason = choice["finish_reason"] or reason
            for d in delta.get("tool_calls") or ():
                call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                call["name"] += d.get("function", {}).get("name") or ""
                call["arguments"] += d.get("function", {}).get("arguments") or ""
    assert reason == whole["finish_reason"]
    want = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in whole["message"].get("tool_calls") or ()]
    assert [calls[i] for i in sorted(calls)] == want
    assert content == (whole["message"]["content"] or "")
    # a call's arguments stream in pieces after its id and name, "required" calls' as well
    pieces = [d for ch in chunks for c in ch["choices"] for d in c["delta"].get("tool_calls") or ()]
    assert want and len(want[0]["arguments"]) > 4
    assert len(pieces) > 2 and "id" in pieces[0] and "id" not in pieces[1]


def test_the_python_client_parses_a_json_schema_answer(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    c = resp.choices[0]
    if c.finish_reason == "stop":
        jsonschema.validate(json.loads(c.message.content), PERSON)
    else:
        assert c.finish_reason == "length"


BAD = {
    "json_schema without its object": (CHAT, _chat(response_format={"type": "json_schema"}), "response_format"),
    "json_schema without a name": (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "schema": PERSON}}), "response_format"),
    "an unknown format type": (CHAT, _chat(response_format={"type": "xml"}), "response_format"),
    "a schema that does not compile": (CHAT, _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}), "response_format!"),
    "a bad regex": (COMPLETIONS, dict(model=MODEL, prompt="x", structured_outputs={"regex": "(ab"}),
                    "structured_outputs!"),
    "two structured_outputs": (CHAT, _chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
    "an empty structured_outputs": (CHAT, _chat(structured_outputs={}), "structured_outputs"),
    "an unknown structured_outputs key": (CHAT, _chat(structured_outputs={"xml": "a"}), "structured_outputs"),
    "an empty choice": (CHAT, _chat(structured_outputs={"choice": []}), "structured_outputs"),
    "both forms": (CHAT, _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
                   "structured_outputs"),
    "a forced call and vLLM's form": (CHAT, _chat(tools=[WEATHER], tool_choice="required",
                                                  structured_outputs={"regex": "a"}), "tool_choice"),
    "required without tools": (CHAT, _chat(tool_choice="required"), "tool_choice"),
    "a named tool not given": (CHAT, _chat(tools=[WEATHER], tool_choice={"type": "function",
                                                                         "function": {"name": "nope"}}), "tool_choice"),
    "an unknown tool_choice": (CHAT, _chat(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
    "a tool whose schema does not compile": (CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}}}], tool_choice="required"), "tool_choice!"),
    "a strict tool whose schema does not compile": (CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nope"}, "strict": True}}]), "tools!"),
    "strict tools beside vLLM's form": (CHAT, _chat(tools=[_strict(WEATHER)], structured_outputs={"regex": "a"}),
                                        "structured_outputs"),
    "strict not a boolean": (CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "strict": "yes"}}]), "tools"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_structured_requests_are_400s_naming_the_field(raw, name):
    path, body, param = BAD[name]
    resp = raw.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    # "field!": the grammar did not compile, in the engine; the field that asked is named
    assert error["param"] == param.rstrip("!"), error
    assert ("cannot be compiled" in error["message"]) == param.endswith("!"), error


def test_a_streamed_json_answer_equals_the_whole_one(raw):
    body = _chat(response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}, seed=2)
    whole = raw.post(CHAT, json=body).json()["choices"][0]
    resp = raw.post(CHAT, json=dict(body, stream=True, stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    validator = _schema("ChatCompletionChunk")
    for chunk in chunks:
        validator.validate(chunk)
    content = "".join(c["delta"].get("content") or "" for ch in chunks for c in ch["choices"])
    reasons = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert content == whole["message"]["content"] and reasons == [whole["finish_reason"]]
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_request_models_keep_their_aliased_fields():
    """The Python handle API takes request models too: their "schema" and "json" fields (aliases)
    reach the engine."""
    from app import openai_api as oa
    from app.service import OpenAIService

    class Backend:
        model_name, max_model_len = MODEL, 4096
    service = OpenAIService(Backend())
    chat = oa.ChatCompletionRequest.model_validate(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
    _, engine_request = service.parse("chat", chat)
    assert json.loads(engine_request["sampling"]["structured_output"]["value"]) == PERSON
    completion = oa.CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"json": PERSON}})
    _, engine_request = service.parse("completion", completion)
    assert json.loads(engine_request["sampling"]["structured_output"]["value"]) == PERSON


def _calls_begin(raw) -> int:
    (token,) = raw.post("/tokenize", json={"model": MODEL, "prompt": CALLS_BEGIN}).json()["tokens"]
    return token


def _answers(responses: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the calls of the answers that called, the answers that gave content), of those that stopped."""
    calls, contents = [], []
    for r in responses:
        _schema("ChatCompletion").validate(r)
        c = r["choices"][0]
        if c["finish_reason"] == "tool_calls":
            assert c["message"]["content"] is None
            calls += c["message"]["tool_calls"]
        elif c["finish_reason"] == "stop":
            contents.append(c["message"])
    return calls, contents


def test_strict_tools_hold_auto_mode_calls_to_their_schemas(raw):
    """The bias makes the random model open a block of calls at once; the structural tag then
    holds each call's name to the tools' and its arguments to the strict tool's schema, and ends
    the answer after the block."""
    bias = {str(_calls_begin(raw)): 100}
    body = _chat(tools=[_strict(WEATHER), CLOCK], logit_bias=bias, max_tokens=60)
    calls, _ = _answers(_seeds(raw, CHAT, body, range(6)))
    assert calls
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] in ("weather", "clock")
        if call["function"]["name"] == "weather":
            jsonschema.validate(args, WEATHER["function"]["parameters"])
        else:  # not strict: any object
            assert isinstance(args, dict)
    one = _seeds(raw, CHAT, dict(body, parallel_tool_calls=False), range(4))
    assert all(len(r["choices"][0]["message"].get("tool_calls") or []) <= 1 for r in one)
    # without a strict tool the calls are the model's own: the bias then repeats the marker, no call in it
    loose = raw.post(CHAT, json=_chat(tools=[WEATHER, CLOCK], logit_bias=bias, max_tokens=8)).json()
    assert loose["choices"][0]["finish_reason"] == "length" and not loose["choices"][0]["message"].get("tool_calls")


def test_tools_and_a_response_format_give_the_format_or_calls(raw, tiny_ckpt):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    # the random model takes the calls' branch if it may: the tokens that could start the marker barred
    hf = Tokenizer(tiny_ckpt).hf
    barred = {str(t): -100 for t in range(hf.vocab_size)
              if (text := hf.decode([t])) and CALLS_BEGIN.startswith(text)}
    _, contents = _answers(_seeds(raw, CHAT, _chat(tools=[WEATHER], response_format=rf, logit_bias=barred),
                                  range(4)))
    assert contents
    for message in contents:
        jsonschema.validate(json.loads(message["content"]), PERSON)
    # the bias opens the block of calls; inside a string it would repeat the marker (text there) to
    # the end, so no quote: the random model's arguments are then an empty object
    bias = {str(_calls_begin(raw)): 100, **{str(t): -100 for t in range(hf.vocab_size) if '"' in hf.decode([t])}}
    calls, _ = _answers(_seeds(raw, CHAT, _chat(tools=[WEATHER], response_format=rf, logit_bias=bias), range(4)))
    assert calls and all(c["function"]["name"] == "weather" for c in calls)
    for call in calls:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_a_forced_call_wins_over_a_response_format(raw):
    body = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}},
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    calls, _ = _answers(_seeds(raw, CHAT, body))
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


def test_the_tool_call_parser_picks_the_form_strict_calls_are_held_to():
    from app.config import parse_app_config
    from app.service import OpenAIService

    class Backend:
        model_name, max_model_len = MODEL, 4096
    body = _chat(tools=[_strict(WEATHER)])
    forms = {}
    for parser in ("deepseek_v31", "deepseek_v3"):
        _, engine_request = OpenAIService(Backend(), tool_call_parser=parser).parse("chat", body)
        spec = engine_request["sampling"]["structured_output"]
        assert spec["kind"] == "structural_tag" and engine_request["structured_field"] == "tools"
        forms[parser] = json.loads(spec["value"])["format"]["tags"][0]["content"]["tags"][0]["begin"]
    assert forms == {"deepseek_v31": "<｜tool▁call▁begin｜>weather<｜tool▁sep｜>",
                     "deepseek_v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n"}
    assert parse_app_config({"model": {"preset": "tiny"}}).model.tool_call_parser == "deepseek_v31"
    with pytest.raises(Exception, match="tool_call_parser"):
        parse_app_config({"model": {"preset": "tiny", "tool_call_parser": "hermes"}})
