"""Fuzzes the OpenAI HTTP API of build_http_app() on a real tiny engine behind uvicorn.

Two sources of requests: cases generated from the API's own OpenAPI document (app/openapi.py)
by schemathesis, valid ones and deliberately invalid ones, and hand-written hostile inputs
(oversized, deeply nested, malformed bytes, absurd values). Every response must be below 500,
match the document, and every 4xx must be an OpenAI-style error; afterwards the server must be
healthy, still answer, and the engine must hold no request and no KV block.

    python -m bench.fuzz_http --cases 2000
"""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator

import httpx2 as httpx
import jsonschema
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core import NotSet
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi import checks as openapi_checks

from app.http import build_http_app
from app.local_backend import LocalBackend
from app.openapi import openapi_spec
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

MODEL = "tiny-fuzz"
API_KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
MAX_MODEL_LEN = 256
MAX_TOKENS_LIMIT = 64
MAX_BODY = 1_000_000
TIMEOUT_S = 60


@dataclass
class Tally:
    tried: Counter = field(default_factory=Counter)      # cases per source ("schema:POST /v1/... positive", "hand")
    statuses: Counter = field(default_factory=Counter)   # responses per status code
    failures: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.tried.values())

    def fail(self, what: str) -> None:
        self.failures.append(what)


# --- the server ----------------------------------------------------------------------------

@contextlib.contextmanager
def serve(checkpoint: str, *, max_model_len: int = MAX_MODEL_LEN, max_tokens_limit: int = MAX_TOKENS_LIMIT,
          max_body_bytes: int = MAX_BODY) -> Iterator[SimpleNamespace]:
    """build_http_app on a LocalBackend, served by uvicorn in a thread on a free loopback port."""
    engine = LLMEngine.from_pretrained(checkpoint, EngineConfig(block_size=4, max_model_len=max_model_len),
                                       progress=False)
    async_engine = AsyncLLMEngine(engine)
    backend = LocalBackend(async_engine, MODEL)
    app = build_http_app(backend, api_key=API_KEY, max_body_bytes=max_body_bytes, max_tokens_limit=max_tokens_limit)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        host, port = sock.getsockname()
        # the document the app serves, tightened with the vocabulary only this side knows
        spec = openapi_spec(MODEL, max_model_len=max_model_len, max_tokens_limit=max_tokens_limit,
                            max_body_bytes=max_body_bytes, vocab_size=engine.model_cfg.vocab_size, auth=True)
        yield SimpleNamespace(url=f"http://{host}:{port}", port=port, engine=async_engine, spec=spec,
                              vocab_size=engine.model_cfg.vocab_size, max_body_bytes=max_body_bytes,
                              max_model_len=max_model_len, max_tokens_limit=max_tokens_limit)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        async_engine.shutdown()
        sock.close()


# --- response checks shared by both sources ------------------------------------------------

def openai_error_problem(status: int, text: str) -> str | None:
    """Why a 4xx/5xx body is not exactly {"error": {message, type, param, code}}, or None."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"{status} body is not JSON: {text[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"{status} body is not an error object: {text[:200]!r}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"{status} error has keys {sorted(err)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return f"{status} error message/type malformed: {err!r}"
    if not all(err[k] is None or isinstance(err[k], str) for k in ("param", "code")):
        return f"{status} error param/code not string-or-null: {err!r}"
    return None


def _schema_validator(spec: dict, name: str) -> jsonschema.Validator:
    # the component refs are "#/components/schemas/..." so they resolve inside this wrapper
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": spec["components"]})


def sse_problem(spec: dict, path: str, text: str) -> str | None:
    """Why a text/event-stream body is not a valid chunk stream ending in [DONE], or None."""
    chunk = _schema_validator(spec, "ChatCompletionChunk" if path == CHAT else "TextCompletionChunk")
    error = _schema_validator(spec, "Error")
    events = [block for block in text.split("\n\n") if block.strip()]
    if not events or events[-1] != "data: [DONE]":
        return f"stream does not end with [DONE]: {text[-200:]!r}"
    for event in events[:-1]:
        if not event.startswith("data: "):
            return f"not a data event: {event[:200]!r}"
        obj = json.loads(event[len("data: "):])
        validator = error if "error" in obj else chunk
        problem = jsonschema.exceptions.best_match(validator.iter_errors(obj))
        if problem is not None:
            return f"stream event does not match the schema: {problem.message} in {event[:200]!r}"
    return None


# --- schema-generated cases ----------------------------------------------------------------

SCHEMA_CHECKS = [not_a_server_error, openapi_checks.status_code_conformance,
                 openapi_checks.content_type_conformance, openapi_checks.response_headers_conformance,
                 openapi_checks.response_schema_conformance]


def schema_plan(cases: int) -> dict[tuple[str, str, str], int]:
    """How many cases each (method, path, mode) gets: the GETs take no input, so one case each
    says all there is; a tenth goes to /tokenize and /detokenize (small bodies, nothing generated);
    the rest is split over the two generation POSTs, valid and invalid alike."""
    plan = {("GET", "/v1/models", "positive"): 1, ("GET", "/health", "positive"): 1}
    tokens = [("POST", p, mode) for p in (TOKENIZE, DETOKENIZE) for mode in ("positive", "negative")]
    for key in tokens:
        plan[key] = max(1, cases // 40)
    posts = [(m, p, mode) for m, p in (("POST", CHAT), ("POST", COMPLETIONS)) for mode in ("positive", "negative")]
    share, extra = divmod(max(cases - sum(plan.values()), len(posts)), len(posts))
    for i, key in enumerate(posts):
        plan[key] = share + (i < extra)
    return plan


def _case_runner(served: SimpleNamespace, tally: Tally, session: requests.Session, label: str, path: str,
                 checks: list) -> Callable[[Any], None]:
    def one(case) -> None:
        tally.tried[label] += 1
        try:
            response = case.call(base_url=served.url, session=session, headers=AUTH, timeout=TIMEOUT_S)
        except Exception as e:  # a dropped connection is as much a failure as a 500
            tally.fail(f"{label}: request failed: {e!r}\n  request body: {json.dumps(case.body, default=repr)}")
            return
        tally.statuses[response.status_code] += 1
        problems = []
        try:
            case.validate_response(response, checks=checks, headers=AUTH)
        except (Exception, FailureGroup) as e:
            problems.append(str(e))
        text = response.content.decode("utf-8", "replace")
        if response.status_code >= 400:
            problems.append(openai_error_problem(response.status_code, text))
        if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
            problems.append(sse_problem(served.spec, path, text))
        problems = [p for p in problems if p]
        if problems:
            sent = json.dumps(case.body) if not isinstance(case.body, NotSet) else "(no body)"
            tally.fail(f"{label}: " + "\n".join(problems) + f"\n  request body: {sent}\n  response "
                       f"{response.status_code}: {text[:2000]!r}")

    return one


def run_schema_cases(served: SimpleNamespace, tally: Tally, *, cases: int, seed: int | None = None) -> dict:
    """Generates and sends `cases` requests from the OpenAPI document; returns the plan."""
    # unsanitized: the fields it would hide (max_tokens, stop_token_ids, ...) are the interesting ones;
    # streams are read whole (a token per event, plus role, finish and usage events), since a
    # stream cut short by the client could not be told from one the server broke off
    config = schemathesis.Config.from_dict({"max-stream-events": 4 * served.max_tokens_limit + 16,
                                            "output": {"sanitization": {"enabled": False}}})
    schema = schemathesis.openapi.from_dict(served.spec, config=config)
    operations = {(op.method.upper(), op.path): op for op in (r.ok() for r in schema.get_all_operations())}
    plan = schema_plan(cases)
    session = requests.Session()
    for (method, path, mode), n in plan.items():
        op = operations[(method, path)]
        label = f"schema:{method} {path} {mode}"
        checks = SCHEMA_CHECKS + ([openapi_checks.negative_data_rejection] if mode == "negative" else [])
        strategy = op.as_strategy(schemathesis.GenerationMode(mode))

        run = given(case=strategy)(_case_runner(served, tally, session, label, path, checks))
        run = settings(max_examples=n, derandomize=seed is None, database=None, deadline=None,
                       phases=[Phase.generate], suppress_health_check=list(HealthCheck))(run)
        if seed is not None:
            run = hypothesis_seed(seed)(run)
        run()
    return plan


# --- hand-written cases --------------------------------------------------------------------

@dataclass
class HandCase:
    name: str
    path: str
    body: bytes | Callable[[], Iterable[bytes]] | None
    expect: set[int]
    method: str = "POST"
    headers: dict[str, str | bytes] = field(default_factory=dict)


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


def _strict(tool: dict) -> dict:
    return {"type": "function", "function": dict(tool["function"], strict=True)}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _chat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def _j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _with_raw(obj: dict, key: str, raw: str) -> bytes:
    """`obj` as JSON with `key` set to a raw JSON fragment (NaN, 1e999, ...) that json.dumps won't write."""
    text = json.dumps({**obj, key: "__RAW__"})
    return text.replace('"__RAW__"', raw).encode()


UNICODE_TEXTS = {
    "combining marks": "e\u0301\u0301\u0301 a\u0308\u20dd Z\u0351\u0352\u0357\u035b",
    "right-to-left": "\u05e9\u05dc\u05d5\u05dd \u202e\u0627\u0644\u0639\u0631\u0628\u064a\u0629\u202c",
    "emoji ZWJ and flags": "\U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F1EF\U0001F1F5 \U0001F44D\U0001F3FD",
    "NUL and controls": "a\u0000b\u0001\u001f\u007f",
    "BOM inside": "\ufeffhello\ufeff",
    "noncharacters": "\uffff\ufffe\U0010ffff\ufdd0",
    "astral via surrogate pair escape": "\U0001F600",
    "line and paragraph separators": "a\u2028b\u2029c\r\n",
}


def hand_cases(vocab_size: int, max_body: int, max_model_len: int) -> list[HandCase]:
    bad, ok, ok_or_bad = {400}, {200}, {200, 400}
    big = _j({"messages": [{"role": "user", "content": "x" * max_body}]})
    cases = [
        HandCase("body over the limit, declared", CHAT, big, {413}),
        HandCase("body over the limit, chunked", CHAT, lambda: (big[i:i + 65536] for i in range(0, len(big), 65536)),
                 {413}),
        HandCase("endless chunked body", CHAT, lambda: (b" " * 65536 for _ in range(max_body // 65536 + 4)), {413}),
        HandCase("empty body", CHAT, b"", bad),
        HandCase("whitespace body", COMPLETIONS, b" \n\t ", bad),
        HandCase("top-level array", CHAT, _j([_chat()]), bad),
        HandCase("top-level array of nothing", COMPLETIONS, b"[]", bad),
        HandCase("top-level null", CHAT, b"null", bad),
        HandCase("top-level number", COMPLETIONS, b"1e999", bad),
        HandCase("object nested 100k levels", CHAT, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, bad),
        HandCase("array nested 100k levels in messages", CHAT,
                 b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}", bad),
        HandCase("invalid UTF-8 byte", CHAT, b'{"messages": [{"role": "user", "content": "\xff"}]}', bad),
        HandCase("overlong UTF-8 slash", CHAT, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}', bad),
        HandCase("UTF-8-encoded surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
                 bad),
        HandCase("truncated UTF-8 sequence", COMPLETIONS, b'{"prompt": "\xe2\x82"}', bad),
        HandCase("lone high surrogate escape", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', bad),
        HandCase("lone low surrogate escape", COMPLETIONS, b'{"prompt": "a\\udfffb", "max_tokens": 2}', bad),
        HandCase("lone surrogate in a stop string", CHAT, _with_raw(_chat(), "stop", '"\\udbff"'), bad),
        HandCase("lone surrogate in a key", CHAT, _with_raw(_chat(), "extra", '{"\\ud800": 1}'), bad),
        HandCase("UTF-8 BOM before the body", CHAT, b"\xef\xbb\xbf" + _j(_chat()), bad),
        HandCase("UTF-16 body", CHAT, _j(_chat()).decode().encode("utf-16"), bad),
        HandCase("NaN temperature", CHAT, _with_raw(_chat(), "temperature", "NaN"), bad),
        HandCase("Infinity top_p", CHAT, _with_raw(_chat(), "top_p", "Infinity"), bad),
        HandCase("-Infinity temperature", COMPLETIONS, _with_raw(_completion(), "temperature", "-Infinity"), bad),
        HandCase("temperature overflowing to inf", CHAT, _with_raw(_chat(), "temperature", "1e999"), bad),
        HandCase("top_p overflowing to inf", COMPLETIONS, _with_raw(_completion(), "top_p", "1e400"), bad),
        HandCase("temperature huge but finite", CHAT, _j(_chat(temperature=1e308)), ok),
        HandCase("temperature tiny positive", CHAT, _j(_chat(temperature=5e-324)), ok),
        HandCase("temperature negative", CHAT, _j(_chat(temperature=-0.5)), bad),
        HandCase("temperature negative zero", CHAT, _with_raw(_chat(), "temperature", "-0.0"), ok),
        HandCase("top_p negative", COMPLETIONS, _j(_completion(top_p=-1)), bad),
        HandCase("top_p above one", COMPLETIONS, _j(_completion(top_p=1.0000001)), bad),
        HandCase("top_p tiny", CHAT, _j(_chat(top_p=5e-324)), ok),
        HandCase("top_k negative", CHAT, _j(_chat(top_k=-2)), bad),
        HandCase("top_k huge", COMPLETIONS, _j(_completion(top_k=10**30)), ok),
        HandCase("suffix: fill in the middle", COMPLETIONS, _j(_completion(suffix="\u0000\"<｜fim▁hole｜>")), ok),
        HandCase("suffix streamed", COMPLETIONS, _j(_completion(suffix="x", stream=True)), ok),
        HandCase("suffix with echo", COMPLETIONS, _j(_completion(suffix="x", echo=True)), bad),
        HandCase("suffix after token ids", COMPLETIONS, _j(_completion(prompt=[1, 2], suffix="x")), bad),
        HandCase("top_k a float", COMPLETIONS, _j(_completion(top_k=5.0)), bad),
        HandCase("seed below int64", CHAT, _j(_chat(seed=-(2**63) - 1)), bad),
        HandCase("seed at uint64 max", CHAT, _j(_chat(seed=2**64 - 1, temperature=1.0)), ok),
        HandCase("seed with 5000 digits", CHAT, _with_raw(_chat(), "seed", "9" * 5000), bad),
        HandCase("max_tokens huge", CHAT, _j(_chat(max_tokens=10**12)), bad),
        HandCase("max_tokens 10**100", COMPLETIONS, _j(_completion(max_tokens=10**100)), bad),
        HandCase("max_completion_tokens huge", CHAT, _j(_chat(max_completion_tokens=2**63)), bad),
        HandCase("max_tokens negative", COMPLETIONS, _j(_completion(max_tokens=-(2**70))), bad),
        HandCase("max_tokens boolean", CHAT, _j(_chat(max_tokens=True)), bad),
        # both limits are checked when both are given, as the document (and OpenAI) say
        HandCase("invalid max_tokens beside a valid max_completion_tokens", CHAT,
                 _j(_chat(max_tokens=-3, max_completion_tokens=2)), bad),
        HandCase("thousands of stop strings", CHAT, _j(_chat(stop=[f"s{i}" for i in range(5000)])), bad),
        HandCase("the most stop strings allowed", CHAT, _j(_chat(stop=[f"s{i}" for i in range(64)])), ok),
        HandCase("a stop string too long", COMPLETIONS, _j(_completion(stop="x" * 257)), bad),
        HandCase("stop strings not strings", COMPLETIONS, _j(_completion(stop=[1, 2])), bad),
        HandCase("thousands of stop token ids", CHAT, _j(_chat(stop_token_ids=list(range(20000)))), ok),
        HandCase("stop token id huge", CHAT, _j(_chat(stop_token_ids=[10**30])), ok),
        HandCase("stop token id negative", CHAT, _j(_chat(stop_token_ids=[-1])), bad),
        HandCase("the most top_logprobs allowed, streamed", CHAT,
                 _j(_chat(logprobs=True, top_logprobs=20, stream=True)), ok),
        HandCase("top_logprobs huge", CHAT, _j(_chat(logprobs=True, top_logprobs=10**30)), bad),
        HandCase("top_logprobs with logprobs false", CHAT, _j(_chat(logprobs=False, top_logprobs=1)), bad),
        HandCase("logprobs null beside top_logprobs null", CHAT, _j(_chat(logprobs=None, top_logprobs=None)), ok),
        HandCase("the most legacy logprobs allowed, streamed", COMPLETIONS,
                 _j(_completion(logprobs=20, stream=True)), ok),
        HandCase("legacy logprobs negative", COMPLETIONS, _j(_completion(logprobs=-1)), bad),
        HandCase("the most logit_bias entries allowed", CHAT, _j(_chat(logit_bias={str(i): -1 for i in range(300)})),
                 ok),
        HandCase("one logit_bias entry too many", CHAT, _j(_chat(logit_bias={str(i): -1 for i in range(301)})), bad),
        HandCase("logit_bias key in Arabic-Indic digits", COMPLETIONS, _j(_completion(logit_bias={"\u0661": 1})),
                 bad),
        HandCase("logit_bias key of 5000 digits", CHAT, _j(_chat(logit_bias={"9" * 5000: 1})), bad),
        HandCase("logit_bias value infinite", CHAT, _with_raw(_chat(), "logit_bias", '{"5": 1e999}'), bad),
        HandCase("tools filling the context", CHAT, _j(_chat(tools=[_tool(f"f{i}") for i in range(2000)])), bad),
        HandCase("a tool with a deeply nested schema", CHAT, _j(_chat(tools=[_tool("f", _nested(200))])), ok_or_bad),
        HandCase("a tool call and its answer, streamed", CHAT, _j(_chat(stream=True, tools=[_tool("f")], messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "done"}])), ok),
        HandCase("a tool call's arguments an object", CHAT, _j(_chat(messages=[{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}])), bad),
        HandCase("tool_choice naming a function", CHAT,
                 _j(_chat(tools=[_tool("f")], tool_choice={"type": "function", "function": {"name": "f"}})), ok),
        HandCase("tool_choice naming a function not given", CHAT,
                 _j(_chat(tools=[_tool("f")], tool_choice={"type": "function", "function": {"name": "g"}})), bad),
        HandCase("a forced call of a tool with a deeply nested schema", CHAT,
                 _j(_chat(tools=[_tool("f", _nested(200))], tool_choice="required")), ok_or_bad),
        HandCase("a strict tool with a deeply nested schema", CHAT,
                 _j(_chat(tools=[_strict(_tool("f", _nested(200)))])), ok_or_bad),
        HandCase("a strict tool whose schema takes nothing", CHAT, _j(_chat(tools=[_strict(_tool("f", {"not": {}}))])),
                 ok_or_bad),
        HandCase("a strict tool named with the call markers", CHAT, _j(_chat(tools=[_strict(_tool(
            "f<\uff5ctool\u2581sep\uff5c>{}<\uff5ctool\u2581call\u2581end\uff5c>"))])), ok_or_bad),
        HandCase("strict tools beside a response_format, streamed", CHAT, _j(_chat(
            stream=True, tools=[_strict(_tool("f")), _tool("g")], parallel_tool_calls=False,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}})),
                 ok),
        HandCase("a json_schema nested past what JSON writes", CHAT, _j(_chat(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": _nested(400)}})), ok_or_bad),
        HandCase("a left-recursive grammar", COMPLETIONS,
                 _j(_completion(structured_outputs={"grammar": 'root ::= root "a"'})), bad),
        HandCase("a regex nested 5000 deep", COMPLETIONS,
                 _j(_completion(structured_outputs={"regex": "(" * 5000 + ")" * 5000})), bad),
        HandCase("a regex of a billion repeats", COMPLETIONS,
                 _j(_completion(structured_outputs={"regex": "a{1000000000}"})), ok),
        HandCase("a json schema that takes nothing", CHAT, _j(_chat(response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": False}})), bad),
        HandCase("prompt_logprobs negative", COMPLETIONS, _j(_completion(prompt_logprobs=-1, echo=True, logprobs=1)),
                 bad),
        HandCase("prompt_logprobs streamed", CHAT, _j(_chat(prompt_logprobs=1, stream=True)), bad),
        HandCase("prompt_logprobs beside echo's logprobs", COMPLETIONS,
                 _j(_completion(prompt_logprobs=20, echo=True, logprobs=0, n=2)), ok),
        HandCase("tokenize a conversation with tools", TOKENIZE, _j({"messages": [{"role": "user", "content": "hi"}],
                                                                   "tools": [_tool("f")], "return_token_strs": True}),
                 ok),
        HandCase("tokenize both a prompt and messages", TOKENIZE,
                 _j({"prompt": "a", "messages": [{"role": "user", "content": "hi"}]}), bad),
        HandCase("tokenize an empty prompt", TOKENIZE, _j({"prompt": ""}), bad),
        HandCase("detokenize an id past the vocabulary", DETOKENIZE, _j({"tokens": [1, vocab_size]}), bad),
        HandCase("detokenize nothing", DETOKENIZE, _j({"tokens": []}), ok),
        HandCase("structured_outputs streamed with n", CHAT,
                 _j(_chat(structured_outputs={"choice": ["a", "b"]}, n=3, stream=True)), ok),
        HandCase("the most choices allowed, streamed", CHAT, _j(_chat(n=64, stream=True, max_tokens=2)), ok),
        HandCase("one choice too many", COMPLETIONS, _j(_completion(n=65)), bad),
        HandCase("every penalty at its limit", COMPLETIONS, _j(_completion(presence_penalty=-2, frequency_penalty=2,
                                                                           repetition_penalty=100)), ok),
        HandCase("token id = vocab size", COMPLETIONS, _j(_completion(prompt=[vocab_size])), bad),
        HandCase("token id negative", COMPLETIONS, _j(_completion(prompt=[1, -1])), bad),
        HandCase("token id 2**63", COMPLETIONS, _j(_completion(prompt=[2**63])), bad),
        HandCase("token id 10**30 in a batch of one", COMPLETIONS, _j(_completion(prompt=[[10**30]])), bad),
        HandCase("token ids as floats", COMPLETIONS, _j(_completion(prompt=[1.0, 2.0])), bad),
        HandCase("token ids mixed with text", COMPLETIONS, _j(_completion(prompt=[1, "a"])), bad),
        HandCase("empty token batch", COMPLETIONS, _j(_completion(prompt=[[]])), bad),
        HandCase("empty prompt string", COMPLETIONS, _j(_completion(prompt="")), bad),
        HandCase("prompt of vocab-edge ids", COMPLETIONS, _j(_completion(prompt=[0, vocab_size - 1])), ok),
        HandCase("prompt one token short of the context", COMPLETIONS,
                 _j(_completion(prompt=[5] * (max_model_len - 4), max_tokens=3)), ok),
        HandCase("prompt exactly filling the context", COMPLETIONS,
                 _j(_completion(prompt=[5] * (max_model_len - 3), max_tokens=3)), ok_or_bad),
        HandCase("prompt over the context", COMPLETIONS, _j(_completion(prompt=[5] * max_model_len)), bad),
        HandCase("10k messages", CHAT, _j(_chat(messages=[{"role": "user", "content": "a"}] * 10_000)), bad),
        HandCase("message without role", CHAT, _j(_chat(messages=[{"content": "a"}])), bad),
        HandCase("message content an object", CHAT, _j(_chat(messages=[{"role": "user", "content": {}}])), bad),
        HandCase("text part without text", CHAT, _j(_chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
                 bad),
        HandCase("null content from the assistant", CHAT, _j(_chat(messages=[
            {"role": "user", "content": "a"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "b"}])), ok),
        HandCase("duplicate keys, the last one valid", CHAT,
                 b'{"max_tokens": -5, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}', ok),
        HandCase("duplicate keys, the last one invalid", CHAT,
                 b'{"max_tokens": 2, "max_tokens": -5, "messages": [{"role": "user", "content": "hi"}]}', bad),
        HandCase("content-type text/plain", CHAT, _j(_chat()), ok, headers={"Content-Type": "text/plain"}),
        HandCase("form-encoded body", CHAT, b"model=x&messages=hi", bad,
                 headers={"Content-Type": "application/x-www-form-urlencoded"}),
        HandCase("multipart body", COMPLETIONS, b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--b--',
                 bad, headers={"Content-Type": "multipart/form-data; boundary=b"}),
        HandCase("gzip content-encoding not applied", CHAT, b"\x1f\x8b\x08\x00garbage", bad,
                 headers={"Content-Encoding": "gzip"}),
        HandCase("echo with logprobs", COMPLETIONS, _j(_completion(echo=True, logprobs=5, max_tokens=2)), ok),
        HandCase("echo of token ids, streamed", COMPLETIONS,
                 _j(_completion(prompt=[5, 6, 7], echo=True, logprobs=0, stream=True)), ok),
        HandCase("echo with logprobs and n=3", COMPLETIONS, _j(_completion(echo=True, logprobs=1, n=3)), ok),
        HandCase("echo a string", COMPLETIONS, _j(_completion(echo="yes")), bad),
        HandCase("echo with max_tokens 0", COMPLETIONS, _j(_completion(echo=True, logprobs=2, max_tokens=0)), ok),
        HandCase("max_tokens 0 without echo", COMPLETIONS, _j(_completion(max_tokens=0)), bad),
        HandCase("chat_template_kwargs thinking", CHAT, _j(_chat(chat_template_kwargs={"thinking": True})), ok),
        HandCase("chat_template_kwargs unused and nested", CHAT,
                 _j(_chat(chat_template_kwargs={"x": {"y": [1, None, "z"]}})), ok),
        HandCase("chat_template_kwargs setting the generation prompt", CHAT,
                 _j(_chat(chat_template_kwargs={"add_generation_prompt": False})), bad),
        HandCase("chat_template_kwargs null", CHAT, _j(_chat(chat_template_kwargs=None)), ok),
        HandCase("stream with usage", CHAT, _j(_chat(stream=True, stream_options={"include_usage": True})), ok),
        HandCase("stream_options a string", CHAT, _j(_chat(stream=True, stream_options="yes")), bad),
        HandCase("unknown model", CHAT, _j(_chat(model="gpt-4o")), {404}),
        HandCase("model name with a NUL", COMPLETIONS, _j(_completion(model=MODEL + "\u0000")), {404}),
        HandCase("no API key", CHAT, _j(_chat()), {401}, headers={"Authorization": ""}),
        HandCase("API key with non-ASCII bytes", CHAT, _j(_chat()), {401},
                 headers={"Authorization": "Bearer sk-f\u00fczz".encode("latin-1")}),
        HandCase("session header of 8 KB", CHAT, _j(_chat()), ok, headers={"x-session-id": "s" * 8000}),
        HandCase("session header with Latin-1 bytes", CHAT, _j(_chat()), ok,
                 headers={"x-session-id": "sess-\u00e9\u00ff".encode("latin-1")}),
        HandCase("user of 100k characters", CHAT, _j(_chat(user="u" * 100_000)), ok),
        HandCase("unknown route", "/v1/embeddings", _j(_chat()), {404}),
        HandCase("route with encoded bytes", "/v1/chat%2Fcompletions%00", _j(_chat()), {404}),
        HandCase("GET on a POST route", CHAT, None, {405}, method="GET"),
        HandCase("PUT on a POST route", COMPLETIONS, _j(_completion()), {405}, method="PUT"),
        HandCase("DELETE on models", "/v1/models", None, {405}, method="DELETE"),
        HandCase("POST on health", "/health", b"{}", {405}),
    ]
    for label, text in UNICODE_TEXTS.items():
        cases.append(HandCase(f"unicode chat: {label}", CHAT, _j(_chat(messages=[{"role": "user", "content": text}])),
                              ok))
        cases.append(HandCase(f"unicode prompt and stop: {label}", COMPLETIONS,
                              json.dumps(_completion(prompt=text, stop=[text]), ensure_ascii=False).encode(), ok))
    # the JSON parser gives up on deep nesting near the recursion limit; anything it still accepts
    # goes through validation and error formatting, which must not hit the limit either
    for depth in (500, 900, 950, 980, 990, 995, 999, 1000, 1010, 2000):
        nested = "[" * depth + "]" * depth
        cases.append(HandCase(f"content nested {depth} levels", CHAT,
                              f'{{"messages": [{{"role": "user", "content": {nested}}}]}}'.encode(), bad))
        cases.append(HandCase(f"unknown field nested {depth} levels", COMPLETIONS,
                              f'{{"prompt": "hi", "max_tokens": 2, "x": {nested}}}'.encode(), ok_or_bad))
    return cases


def run_hand_cases(served: SimpleNamespace, tally: Tally, cases: list[HandCase]) -> None:
    with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
        for case in cases:
            tally.tried["hand"] += 1
            headers = {**AUTH, "Content-Type": "application/json", **case.headers}
            headers = {k: v for k, v in headers.items() if v}
            body = case.body() if callable(case.body) else case.body
            try:
                resp = client.request(case.method, case.path, content=body, headers=headers)
            except Exception as e:
                tally.fail(f"hand: {case.name}: request failed: {e!r}")
                continue
            tally.statuses[resp.status_code] += 1
            problems = []
            if resp.status_code not in case.expect:
                problems.append(f"status {resp.status_code}, expected {sorted(case.expect)}: {resp.text[:300]!r}")
            if resp.status_code >= 400:
                problems.append(openai_error_problem(resp.status_code, resp.text))
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                problems.append(sse_problem(served.spec, case.path, resp.text))
            problems = [p for p in problems if p]
            if problems:
                tally.fail(f"hand: {case.name}: " + "; ".join(problems))


# --- afterwards ----------------------------------------------------------------------------

def aftermath_problems(served: SimpleNamespace, timeout: float = 15.0) -> list[str]:
    """What is wrong with the server after the fuzzing: unhealthy, not answering, or holding
    requests or KV blocks (waited for briefly, since a disconnect's abort lands asynchronously)."""
    problems = []
    with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
        health = client.get("/health")
        if health.status_code != 200 or health.json().get("status") != "ok":
            problems.append(f"/health is {health.status_code}: {health.text[:300]}")
        resp = client.post(CHAT, headers=AUTH, json=_chat(max_tokens=3, temperature=0))
        if resp.status_code != 200 or resp.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
            problems.append(f"a normal request got {resp.status_code}: {resp.text[:300]}")
    deadline = time.monotonic() + timeout
    while True:
        stats = served.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            break
        if time.monotonic() > deadline:
            problems.append(f"engine not idle: {stats}")
            break
        time.sleep(0.05)
    return problems


def fuzz(checkpoint: str, *, cases: int, seed: int | None = None) -> tuple[Tally, dict, int, list[str]]:
    """(tally, schema plan, number of hand cases, aftermath problems)."""
    tally = Tally()
    with serve(checkpoint) as served:
        plan = run_schema_cases(served, tally, cases=cases, seed=seed)
        hand = hand_cases(served.vocab_size, served.max_body_bytes, served.max_model_len)
        run_hand_cases(served, tally, hand)
        after = aftermath_problems(served)
    return tally, plan, len(hand), after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="schema-generated cases in total")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized)")
    ap.add_argument("--checkpoint", default=None, help="checkpoint dir (default: a fresh random tiny one)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            from engine.checkpoint import write_random_checkpoint
            from engine.config import preset
            checkpoint = write_random_checkpoint(preset("tiny"), tmp, progress=False)
        start = time.monotonic()
        tally, plan, n_hand, after = fuzz(checkpoint, cases=args.cases, seed=args.seed)
        elapsed = time.monotonic() - start
    print(f"cases tried: {tally.total} ({sum(plan.values())} schema-planned + {n_hand} hand-written) "
          f"in {elapsed:.0f} s")
    for label, n in sorted(tally.tried.items()):
        print(f"  {label}: {n}")
    print("outcomes by status: " + ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())))
    print(f"5xx: {sum(n for s, n in tally.statuses.items() if s >= 500)}; failures: {len(tally.failures)}; "
          f"afterwards: {'healthy and idle' if not after else after}")
    for failure in tally.failures:
        print("FAIL", failure)
    return 0 if not tally.failures and not after and tally.total == sum(plan.values()) + n_hand else 1


if __name__ == "__main__":
    raise SystemExit(main())
