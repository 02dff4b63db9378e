"""Reasoning models: the thinking told from the answer, whole and streamed, through the API
(checked against the OpenAPI document), and V3.1's thinking switch through chat_template_kwargs."""
import random

import pytest

from app.config import parse_app_config
from app.reasoning import ReasoningStream, split_reasoning, starts_in_reasoning
from engine.sampling import SamplingParams
from engine.tokenizer import THINK_BEGIN, THINK_END, Tokenizer
from tests.test_http_api import MODEL, client, offline, served  # noqa: F401
from tests.test_tool_calls import WEATHER, ScriptedBackend, _calls, _respond, _schema

ANSWER = "The user asks about 2 + 2. That is 4." + THINK_END + "\n\n2 + 2 = 4."


@pytest.mark.parametrize("text, reasoning, content", [
    (ANSWER, "The user asks about 2 + 2. That is 4.", "\n\n2 + 2 = 4."),
    (THINK_BEGIN + ANSWER, "The user asks about 2 + 2. That is 4.", "\n\n2 + 2 = 4."),  # older R1 opens it itself
    ("still thinking when max_tokens ran out", "still thinking when max_tokens ran out", ""),
    ("a < b </thin", "a < b </thin", ""),  # a marker's start that never completed is reasoning
    (THINK_END + "answer only", "", "answer only"),
    ("<thinker>" + THINK_END + "x", "<thinker>", "x"),
    (THINK_BEGIN, "", ""),
])
def test_split(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def test_a_stream_cut_anywhere_gives_the_whole_answers_split():
    rng = random.Random(0)
    for text in (THINK_BEGIN + ANSWER, ANSWER, "no end at all </th"):
        want = split_reasoning(text)
        for trial in range(200):
            cuts = (sorted(rng.sample(range(1, len(text)), rng.randint(1, min(20, len(text) - 1)))) if trial
                    else list(range(1, len(text))))
            stream, reasoning, content = ReasoningStream(), "", ""
            for a, b in zip([0, *cuts], [*cuts, len(text)]):
                r, c = stream.feed(text[a:b])
                reasoning, content = reasoning + r, content + c
                assert THINK_END[:3] not in reasoning  # a marker's start is held back, not sent as reasoning
            r, c = stream.finish()
            assert (reasoning + r, content + c) == want


def test_which_answers_start_in_reasoning():
    assert starts_in_reasoning("deepseek_r1", None)
    assert not starts_in_reasoning("deepseek_v3", None)
    assert not starts_in_reasoning("deepseek_v3", {"thinking": False})
    assert starts_in_reasoning("deepseek_v3", {"thinking": True})
    assert not starts_in_reasoning(None, {"thinking": True})


def _service_response(parser, body, text, stream=False, finish_reason="stop"):
    backend = ScriptedBackend(text, finish_reason)
    return backend, _respond(backend, body, stream=stream, reasoning_parser=parser)


BODY = {"messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def test_r1_answers_carry_reasoning_content_whole_and_streamed():
    _, resp = _service_response("deepseek_r1", BODY, ANSWER)
    _schema("ChatCompletion").validate(resp)
    assert resp["choices"][0]["message"] == {"role": "assistant", "reasoning_content": "The user asks about 2 + 2. "
                                             "That is 4.", "content": "\n\n2 + 2 = 4."}
    _, chunks = _service_response("deepseek_r1", BODY, ANSWER, stream=True)
    schema = _schema("ChatCompletionChunk")
    for c in chunks:
        schema.validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks about 2 + 2. That is 4."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\n2 + 2 = 4."
    # the reasoning streams before the content, not all at the end
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert sum(1 for d in deltas[:first_content] if d.get("reasoning_content")) > 3


def test_an_answer_cut_while_thinking_is_all_reasoning():
    _, resp = _service_response("deepseek_r1", BODY, "Let me think about", finish_reason="length")
    message = resp["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think about" and message["content"] == ""
    assert resp["choices"][0]["finish_reason"] == "length"


def test_v3_thinks_only_when_asked_and_the_template_is_told():
    backend, resp = _service_response("deepseek_v3", BODY, ANSWER)
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert backend.requests[0]["chat_template_kwargs"] is None
    thinking = dict(BODY, chat_template_kwargs={"thinking": True})
    backend, resp = _service_response("deepseek_v3", thinking, ANSWER)
    assert resp["choices"][0]["message"]["reasoning_content"] == "The user asks about 2 + 2. That is 4."
    assert backend.requests[0]["chat_template_kwargs"] == {"thinking": True}
    # without a parser the text is left whole
    _, resp = _service_response(None, thinking, ANSWER)
    assert resp["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


def test_reasoning_then_tool_calls():
    text = "I need the weather." + THINK_END + "Checking. " + _calls(("get_weather", '{"city": "Paris"}'))
    body = dict(BODY, tools=[WEATHER])
    _, resp = _service_response("deepseek_r1", body, text)
    (choice,) = resp["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I need the weather."
    assert choice["message"]["content"] == "Checking. "
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    _, chunks = _service_response("deepseek_r1", body, text, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
    assert "".join(d.get("content") or "" for d in deltas) == "Checking. "
    pieces = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["function"]["name"] for c in pieces if "id" in c] == ["get_weather"]
    assert "".join(c["function"]["arguments"] for c in pieces) == '{"city": "Paris"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_think_markers_are_single_tokens_and_thinking_opens_the_answer(tiny_ckpt):
    tok = Tokenizer(tiny_ckpt)
    for marker in (THINK_BEGIN, THINK_END):
        (token,) = tok.encode(marker)
        assert tok.decode([token]) == marker
    messages = [{"role": "user", "content": "hi"}]
    plain = tok.apply_chat_template(messages)
    thinking = tok.apply_chat_template(messages, template_kwargs={"thinking": True})
    assert thinking == plain + tok.encode(THINK_BEGIN)
    assert tok.apply_chat_template(messages, template_kwargs={"thinking": False}) == plain


def test_chat_template_kwargs_reach_the_template(client, offline):
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              extra_body={"chat_template_kwargs": {"thinking": True},
                                                          "ignore_eos": True})
    assert thinking.usage.prompt_tokens == plain.usage.prompt_tokens + 1
    ids = offline.tokenizer.apply_chat_template(messages, template_kwargs={"thinking": True})
    want = offline.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert thinking.choices[0].message.content == want.text


def test_the_parser_is_a_checked_config_field():
    cfg = parse_app_config({"model": {"preset": "tiny", "reasoning_parser": "deepseek_r1"}})
    assert cfg.model.reasoning_parser == "deepseek_r1"
    with pytest.raises(Exception, match="reasoning_parser"):
        parse_app_config({"model": {"preset": "tiny", "reasoning_parser": "qwen3"}})


def test_usage_counts_the_tokens_spent_thinking():
    """ScriptedBackend sends five characters a token: the tokens up to the one that closes the
    reasoning count as reasoning tokens, whole and streamed (the usage chunk)."""
    closing = ANSWER.index(THINK_END) + len(THINK_END)
    want = sum(1 for start in range(0, len(ANSWER), 5) if start < closing)
    _, resp = _service_response("deepseek_r1", BODY, ANSWER)
    assert resp["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    assert resp["usage"]["completion_tokens"] == len(range(0, len(ANSWER), 5)) > want
    _, chunks = _service_response("deepseek_r1", dict(BODY, stream_options={"include_usage": True}), ANSWER,
                                  stream=True)
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
    _schema("ChatCompletion").validate(resp)
    for parser in ("deepseek_v3", None):  # an answer that does not think: no count
        _, plain = _service_response(parser, BODY, ANSWER)
        assert "completion_tokens_details" not in plain["usage"]
