"""Tool calls in a DeepSeek model's answer: found in its text, for a whole answer or as it streams.

The model writes its calls after any content, between the markers of engine/tokenizer.py:
<calls_begin><call_begin>NAME<sep>ARGUMENTS<call_end>...<calls_end> (DeepSeek-V3.1 and later), or
<call_begin>function<sep>NAME\\n```json\\nARGUMENTS\\n```<call_end> (DeepSeek-V3 and R1). Both are read.
A call left unfinished (the answer ran out of tokens) is dropped, as no client could run it.

A forced call (tool_choice "required" or a named function) is not left to the model's format: the
answer is constrained to JSON instead (engine/structured.py), as vLLM does. For a named function it
is the call's arguments; for "required", a list of {"name", "parameters"} objects, one per call.
"""
from __future__ import annotations

import json
import uuid

from engine.tokenizer import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN


def split_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the content before the calls, the calls as {"name", "arguments"})."""
    stream = ToolCallStream()
    content, calls = stream.feed(text)
    return content + stream.finish(), calls


def openai_tool_call(call: dict, index: int | None = None) -> dict:
    """The API's form of a call; `index` (its place in the answer) for a stream's delta."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


class ToolCallStream:
    """Reads an answer's text deltas: passes the content on, holding back only what may be the
    start of the calls' marker, and returns each call once its end marker has arrived."""

    def __init__(self):
        self.buffer = ""
        self.in_calls = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send now, calls completed by this delta)."""
        self.buffer += delta
        if self.in_calls:
            return "", self._completed_calls()
        start = self.buffer.find(CALLS_BEGIN)
        if start >= 0:
            content, self.buffer = self.buffer[:start], self.buffer[start + len(CALLS_BEGIN):]
            self.in_calls = True
            return content, self._completed_calls()
        keep = marker_prefix_len(self.buffer, CALLS_BEGIN)
        content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return content, []

    def finish(self) -> str:
        """The content still held back at the end of the answer (a marker's start that was not one)."""
        rest, self.buffer = ("" if self.in_calls else self.buffer), ""
        return rest

    def _completed_calls(self) -> list[dict]:
        calls = []
        while (end := self.buffer.find(CALL_END)) >= 0:
            body, self.buffer = self.buffer[:end], self.buffer[end + len(CALL_END):]
            begin = body.find(CALL_BEGIN)
            call = _parse_call(body[begin + len(CALL_BEGIN):]) if begin >= 0 else None
            if call is not None:
                calls.append(call)
        self.num_calls += len(calls)
        return calls


def _parse_call(body: str) -> dict | None:
    head, sep, arguments = body.partition(CALL_SEP)
    if not sep:
        return None
    name = head.strip()
    if name == "function":  # DeepSeek-V3's form: the name on the first line, then a JSON block
        name, _, arguments = arguments.partition("\n")
        arguments = arguments.strip()
        if arguments.startswith("```"):
            arguments = arguments.split("\n", 1)[1] if "\n" in arguments else ""
        arguments = arguments.removesuffix("```")
        name = name.strip()
    return {"name": name, "arguments": arguments.strip()} if name else None


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


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


def forced_calls(text: str, forced: str) -> list[dict]:
    """The calls of a whole forced answer ({"name", "arguments"}). A named function's call holds
    whatever arguments were written, as its stream sent them (finish_reason "length" tells a cut
    one); "required" gives none unless its list is complete JSON."""
    if forced != "required":
        return [{"name": forced, "arguments": text.strip()}]
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}
            for c in value if isinstance(c, dict) and "name" in c and "parameters" in c]


class ForcedCallStream:
    """A forced answer's tool-call deltas as it streams. A named function's arguments go out as
    they come, the first delta with the call's id and name, as OpenAI streams them; the calls of
    "required" go out whole at the end, once the list is complete JSON."""

    def __init__(self, forced: str):
        self.forced = forced
        self.text = ""
        self.call_id: str | None = None
        self.num_calls = 0

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.forced == "required" or not delta:
            return []
        if self.call_id is None:
            self.call_id, self.num_calls = f"call_{uuid.uuid4().hex[:24]}", 1
            return [{"index": 0, "id": self.call_id, "type": "function",
                     "function": {"name": self.forced, "arguments": delta}}]
        return [{"index": 0, "function": {"arguments": delta}}]

    def finish(self) -> list[dict]:
        """The calls still to send when the answer ends."""
        if self.forced != "required":
            return []
        calls = forced_calls(self.text, "required")
        self.num_calls = len(calls)
        return [openai_tool_call(c, i) for i, c in enumerate(calls)]
