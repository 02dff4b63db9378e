"""Tool calls held to a grammar: the JSON a forced call is written as, the structural tag that
holds an auto-mode answer's calls to their tools, and the calls read from forced JSON as it streams.

A forced call (tool_choice "required" or a named function) is not left to the model's format: the
answer is constrained to JSON (engine/structured.py), as vLLM does. For a named function it is the
call's arguments; for "required", a list of {"name", "parameters"} objects, one per call. Both
stream as OpenAI streams calls: a call's id and name first, then its arguments in pieces, which are
the text the model wrote (blanks around them left out). A whole answer gives what its stream
sends, put together; a call cut short (max_tokens) keeps what was written, and finish_reason
"length" tells it.

In auto mode the model writes its calls in its own format (app/tool_calls.py reads them). When a
tool is strict (OpenAI's `strict: true`) or the answer has a response_format, that format is held to
a structural tag: each call between DeepSeek's markers, its name one of the tools', its arguments
a strict tool's schema (any JSON object for the others).
"""
from __future__ import annotations

import json
import uuid

from engine.structured import MAX_WHITESPACE
from engine.tokenizer import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN, CALLS_END

_BLANKS = " \t\r\n"


def forced_call_schema(functions: list[dict], forced: str, parallel: bool | None = None) -> dict:
    """The JSON schema an answer forced to call `forced` ("required": any of `functions`, each
    {"name", "parameters"}) is constrained to; parallel False: one call at most."""
    def parameters(f: dict) -> dict:
        return f.get("parameters") or {"type": "object"}
    if forced != "required":
        return parameters(next(f for f in functions if f["name"] == forced))
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": parameters(f)},
                       "required": ["name", "parameters"]} for f in functions]}
    return {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if parallel is False else {})}


def calls_tag(functions: list[dict], parallel: bool | None = None, answer: dict | None = None,
              v3: bool = False) -> dict:
    """The structural tag an auto-mode answer with these tools (each {"name", "parameters",
    "strict"}) is held to. Without `answer`: any text, then at most one block of calls, after which
    the answer ends. With `answer` (a structural-tag format: a response_format's JSON): either that
    answer or the calls. parallel False: one call in the block. v3: the calls in DeepSeek-V3's and
    R1's form (`function`, the name, the arguments in a ```json block, a line between calls), as
    their chat templates write them; else V3.1's."""
    def arguments(f: dict) -> dict:
        return (f.get("parameters") or {"type": "object"}) if f.get("strict") else {"type": "object"}

    def tag(f: dict) -> dict:
        begin, end = (f"function{CALL_SEP}{f['name']}\n```json\n", "\n```") if v3 else (f"{f['name']}{CALL_SEP}", "")
        return {"type": "tag", "begin": CALL_BEGIN + begin, "end": end + CALL_END, "content": {
            "type": "json_schema", "json_schema": arguments(f), "max_whitespace_cnt": MAX_WHITESPACE}}
    calls = {"type": "tag", "begin": CALLS_BEGIN, "end": CALLS_END, "content": {
        "type": "tags_with_separator", "tags": [tag(f) for f in functions], "separator": "\n" if v3 else "",
        "at_least_one": True, "stop_after_first": parallel is False}}
    if answer is not None:
        return {"type": "structural_tag", "format": {"type": "or", "elements": [answer, calls]}}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [CALLS_BEGIN],
                                                 "tags": [calls], "at_least_one": False, "stop_after_first": True}}


def forced_calls(text: str, forced: str) -> list[dict]:
    """The calls of a whole forced answer ({"name", "arguments"}), as its stream sends them."""
    stream = ForcedCallStream(forced)
    stream.feed(text)
    stream.finish()
    return [{"name": c.name, "arguments": c.arguments} for c in stream.calls if c.name is not None]


class _Call:
    def __init__(self):
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.name: str | None = None
        self.args_start: int | None = None  # where its arguments begin in the answer
        self.args_end: int | None = None  # and end, once read
        self.sent = 0  # how much of them has gone out
        self.opened = False  # its first delta (id and name) has gone out
        self.arguments = ""


class ForcedCallStream:
    """Reads a forced answer's text deltas and gives the tool-call deltas to send. For "required"
    it follows the list's JSON a character at a time (strings, escapes and nesting), so each call
    opens once its name's string is closed and its "parameters" value streams as it is written."""

    def __init__(self, forced: str):
        self.forced = forced
        self.text = ""
        self.calls: list[_Call] = []
        self._read = 0  # characters of `text` read
        self._open: list[str] = []  # the containers open around the character being read
        self._in_string = self._escaped = False
        self._key_start: int | None = None  # an element's key being read
        self._key: str | None = None  # the element's key whose value comes next or is being read
        self._colon = False  # past the key's colon, the value not begun
        self._value_start: int | None = None  # an element's value being read
        self._value_kind = ""  # "container", "string" or "scalar"

    @property
    def num_calls(self) -> int:
        return sum(c.name is not None for c in self.calls)

    def feed(self, delta: str) -> list[dict]:
        """Tool-call deltas to send now, each with its "index"."""
        self.text += delta
        if self.forced != "required":
            if not self.calls:
                self.calls.append(_Call())
                self.calls[0].name = self.forced
            call = self.calls[0]
            if call.args_start is None and self.text.strip(_BLANKS):
                call.args_start = len(self.text) - len(self.text.lstrip(_BLANKS))
        else:
            for i in range(self._read, len(self.text)):
                self._char(i)
            self._read = len(self.text)
        return self._deltas()

    def finish(self) -> list[dict]:
        """The deltas still to send when the answer ends."""
        if self.forced == "required" and self._value_start is not None and self._key == "parameters":
            self._end_value(len(self.text))  # cut short inside the arguments: what was written
        return self._deltas()

    def _deltas(self) -> list[dict]:
        out = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            args = ""
            if call.args_start is not None:  # blanks at the end may come before more, or after the arguments
                end = call.args_end if call.args_end is not None else len(self.text)
                args = self.text[call.args_start:end].rstrip(_BLANKS)
            new, call.arguments = args[call.sent:], args
            call.sent = len(args)
            if not call.opened:
                call.opened = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": new}})
            elif new:
                out.append({"index": index, "function": {"arguments": new}})
        return out

    def _char(self, i: int) -> None:
        ch, depth = self.text[i], len(self._open)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if depth == 2 and self._key_start is not None:
                    self._key = _loads(self.text[self._key_start:i + 1])
                    self._key_start = None
                elif depth == 2 and self._value_kind == "string":
                    self._end_value(i + 1)
            return
        if depth == 2 and self._value_kind == "scalar" and (ch in ",}" or ch in _BLANKS):
            self._end_value(i)
        if ch == '"':
            self._in_string = True
            if depth == 2 and self._colon:
                self._begin_value(i, "string")
            elif depth == 2 and self._value_start is None:
                self._key_start = i
        elif ch in "[{":
            if depth == 2 and self._colon:
                self._begin_value(i, "container")
            elif depth == 1 and ch == "{":  # a call begins
                self.calls.append(_Call())
            self._open.append(ch)
        elif ch in "]}":
            if self._open:
                self._open.pop()
            if len(self._open) == 2 and self._value_kind == "container":
                self._end_value(i + 1)
        elif ch == ":" and depth == 2 and self._value_start is None:
            self._colon = True
        elif ch not in _BLANKS and ch != "," and depth == 2 and self._colon:
            self._begin_value(i, "scalar")

    def _begin_value(self, i: int, kind: str) -> None:
        self._colon, self._value_start, self._value_kind = False, i, kind
        if self._key == "parameters" and self.calls:
            self.calls[-1].args_start = i

    def _end_value(self, end: int) -> None:
        call = self.calls[-1] if self.calls else None
        if call is not None and self._key == "name":
            name = _loads(self.text[self._value_start:end])
            call.name = name if isinstance(name, str) else None
        elif call is not None and self._key == "parameters":
            call.args_end = end
        self._value_start, self._value_kind, self._key = None, "", None


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
