"""Tool calls held to a grammar. Forced calls read from their constrained JSON: a stream cut
anywhere sends what the whole answer gives, "required" calls open as soon as their names are
written, and cut answers keep what was written. Auto-mode calls held to their tools by a structural
tag, alone or beside a response_format."""
import random

import pytest

from app.call_grammars import ForcedCallStream, calls_tag, forced_call_schema, forced_calls
from app.tool_calls import split_tool_calls
from engine.structured import GrammarCompiler, validate_spec
from engine.tokenizer import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END


def _streamed(text: str, forced: str, cuts: list[int]) -> tuple[dict[int, dict], list[dict]]:
    stream, deltas, at = ForcedCallStream(forced), [], 0
    for cut in cuts + [len(text)]:
        deltas += stream.feed(text[at:cut])
        at = cut
    deltas += stream.finish()
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls, "a call opened twice"
            calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return calls, deltas


REQUIRED = [
    ('[{"name": "weather", "parameters": {"city": "Paris"}}]',
     [("weather", '{"city": "Paris"}')]),
    ('[ {"name":"weather","parameters":{"city":"Pa\\"ris }]","n":[1,{"x":"}"}]}} ,\n'
     ' {"name": "clock", "parameters": {}}]',
     [("weather", '{"city":"Pa\\"ris }]","n":[1,{"x":"}"}]}'), ("clock", "{}")]),
    ('[{"parameters": {"zone": "UTC"}, "name": "clock"}]', [("clock", '{"zone": "UTC"}')]),
    ('[{"name": "count", "parameters": 12 }, {"name": "say", "parameters": "hi, \\u00e9"}]',
     [("count", "12"), ("say", '"hi, \\u00e9"')]),
    ('[{"name": "na\\u006de", "parameters": {\n  "a": true\n}\n}]', [("name", '{\n  "a": true\n}')]),
    # cut short: a call whose name is written keeps the arguments written so far
    ('[{"name": "weather", "parameters": {"city": "Par', [("weather", '{"city": "Par')]),
    ('[{"name": "weather", "parameters": {"city": "Paris"}}, {"name": "clo', [("weather", '{"city": "Paris"}')]),
    ('[{"name": "wea', []),
    ('[', []),
    ('', []),
]


@pytest.mark.parametrize("text, want", REQUIRED)
def test_required_calls_whole_and_streamed_cut_anywhere(text, want):
    whole = forced_calls(text, "required")
    assert [(c["name"], c["arguments"]) for c in whole] == want
    rng = random.Random(len(text))
    for cuts in [list(range(1, len(text))), []] + [sorted(rng.sample(range(len(text) + 1), min(4, len(text))))
                                                 for _ in range(20)]:
        calls, _ = _streamed(text, "required", cuts)
        assert [calls[i] for i in sorted(calls)] == whole
    assert ForcedCallStream("required").num_calls == 0


def test_a_required_call_opens_once_its_name_is_written_and_its_arguments_stream():
    stream = ForcedCallStream("required")
    assert stream.feed('[{"name": "weath') == []
    (opened,) = stream.feed('er", "parameters": {"ci')
    assert opened["function"] == {"name": "weather", "arguments": '{"ci'} and opened["index"] == 0
    assert opened["id"].startswith("call_") and opened["type"] == "function"
    assert stream.feed('ty": "Oslo"}') == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert stream.feed("}, ") == [] and stream.num_calls == 1
    (second,) = stream.feed('{"name": "clock", "parameters": {}}]')
    assert second["index"] == 1 and second["function"] == {"name": "clock", "arguments": "{}"}
    assert second["id"] != opened["id"]
    assert stream.finish() == [] and stream.num_calls == 2


def test_blanks_inside_arguments_are_held_until_more_comes():
    stream = ForcedCallStream("weather")
    (opened,) = stream.feed('  {"city": "a ')
    assert opened["function"] == {"name": "weather", "arguments": '{"city": "a'}
    assert stream.feed("  ") == []
    assert stream.feed('b"}') == [{"index": 0, "function": {"arguments": '   b"}'}}]
    assert stream.feed(" \n") == [] and stream.finish() == []


@pytest.mark.parametrize("text", ['{"city": "Paris"}', '\n {"city": "Pa', "", "  "])
def test_a_named_call_is_the_answer_without_its_blanks(text):
    (call,) = forced_calls(text, "weather")
    assert call == {"name": "weather", "arguments": text.strip()}
    calls, _ = _streamed(text, "weather", list(range(1, len(text))))
    assert calls == {0: call}


def test_the_schema_a_forced_answer_is_held_to():
    functions = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
                 {"name": "clock"}]
    assert forced_call_schema(functions, "clock") == {"type": "object"}
    assert forced_call_schema(functions, "weather") == functions[0]["parameters"]
    schema = forced_call_schema(functions, "required", parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["weather", "clock"]
    assert "maxItems" not in forced_call_schema(functions, "required")


MARKERS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, CALL_SEP]
TEXTS = {
    "text alone": "Let me think.",
    "a strict call": f'Sure. {CALLS_BEGIN}{CALL_BEGIN}weather{CALL_SEP}{{"city": "Oslo"}}{CALL_END}{CALLS_END}',
    "two calls": (f'{CALLS_BEGIN}{CALL_BEGIN}clock{CALL_SEP}{{"any": [1]}}{CALL_END}'
                  f'{CALL_BEGIN}weather{CALL_SEP}{{"city":"Paris"}}{CALL_END}{CALLS_END}'),
    "a value off the schema": f'{CALLS_BEGIN}{CALL_BEGIN}weather{CALL_SEP}{{"city": "Rome"}}{CALL_END}{CALLS_END}',
    "a tool not given": f'{CALLS_BEGIN}{CALL_BEGIN}radio{CALL_SEP}{{}}{CALL_END}{CALLS_END}',
    "text after the calls": f'{CALLS_BEGIN}{CALL_BEGIN}clock{CALL_SEP}{{}}{CALL_END}{CALLS_END} ok',
    "a tab in a string": f'{CALLS_BEGIN}{CALL_BEGIN}clock{CALL_SEP}{{"a": "x\ty"}}{CALL_END}{CALLS_END}',
    "the format's JSON": '{"name": "Ann", "age": 3}',
}
FUNCTIONS = [{"name": "weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}},
    {"name": "clock", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _accepts(spec: dict, text: str) -> bool:
    """Whether a grammar compiled as the engine compiles it takes `text` and then ends: over a
    vocabulary of one token per character and per marker."""
    chars = sorted({ch for t in TEXTS.values() for ch in t} | set("{}[]\",: \n`0123456789abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["</s>"] + MARKERS + chars
    constraint = GrammarCompiler(None, len(vocabulary), [0], vocabulary=vocabulary).constraint(validate_spec(spec))
    at = 0
    while at < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, at)), None)
        token = vocabulary.index(marker or text[at])
        if not constraint.accept(token):
            return False
        at += len(marker or text[at])
    return constraint.accept(0) and constraint.finished


@pytest.mark.parametrize("parallel, answer, taken", [
    (None, False, {"text alone", "a strict call", "two calls", "the format's JSON"}),  # JSON is text too
    (False, False, {"text alone", "a strict call", "the format's JSON"}),
    (None, True, {"two calls", "the format's JSON"}),
])
def test_the_calls_tag_holds_calls_to_their_tools(parallel, answer, taken):
    fmt = {"type": "json_schema", "json_schema": PERSON} if answer else None
    spec = {"kind": "structural_tag", "value": calls_tag(FUNCTIONS, parallel, fmt)}
    assert {name for name, text in TEXTS.items() if _accepts(spec, text)} == taken


def test_the_calls_tag_in_deepseek_v3s_form():
    """DeepSeek-V3's and R1's form: `function`, the name, the arguments in a ```json block, a line
    between calls; V3.1's form is then refused, and the other way round."""
    v3 = (f'Sure. {CALLS_BEGIN}{CALL_BEGIN}function{CALL_SEP}weather\n```json\n{{"city": "Oslo"}}\n```{CALL_END}\n'
          f'{CALL_BEGIN}function{CALL_SEP}clock\n```json\n{{}}\n```{CALL_END}{CALLS_END}')
    spec = {"kind": "structural_tag", "value": calls_tag(FUNCTIONS, v3=True)}
    assert _accepts(spec, v3) and not _accepts(spec, TEXTS["a strict call"])
    assert not _accepts(spec, v3.replace("Oslo", "Rome"))  # still held to the strict tool's schema
    assert not _accepts({"kind": "structural_tag", "value": calls_tag(FUNCTIONS)}, v3)
    assert split_tool_calls(v3) == ("Sure. ", [{"name": "weather", "arguments": '{"city": "Oslo"}'},
                                               {"name": "clock", "arguments": "{}"}])
