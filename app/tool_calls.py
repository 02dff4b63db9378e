"""Tool calls in a DeepSeek model's answer: found in its text, for a whole answer or as it streams.

The model writes its calls after any content, between the markers of engine/tokenizer.py:
<calls_begin><call_begin>NAME<sep>ARGUMENTS<call_end>...<calls_end> (DeepSeek-V3.1 and later), or
<call_begin>function<sep>NAME\\n```json\\nARGUMENTS\\n```<call_end> (DeepSeek-V3 and R1). Both are read.
A call cut short (the answer ran out of tokens) keeps what was written, as OpenAI's do; the
finish_reason ("length") tells it. Calls stream as OpenAI streams them: a call's name first,
then its arguments in pieces.

A forced call (tool_choice "required" or a named function) is not left to the model's format: see
call_grammars.py.
"""
from __future__ import annotations

import uuid

from engine.tokenizer import CALL_BEGIN, CALL_END, CALL_SEP, CALLS_BEGIN


def split_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the content before the calls, the calls as {"name", "arguments"}): what a stream of the
    same text sends, put together."""
    stream = ToolCallStream()
    content, deltas = stream.feed(text)
    rest, more = stream.finish()
    calls: list[dict] = []
    for d in deltas + more:
        if "id" in d:
            calls.append({"name": d["function"]["name"], "arguments": ""})
        calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content + rest, calls


def openai_tool_call(call: dict, index: int | None = None) -> dict:
    """The API's form of a call; `index` (its place in the answer) for a stream's delta."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call["name"], "arguments": call["arguments"]}}
    return out if index is None else {"index": index, **out}


_FENCE = "```"
_BLANKS = " \t\r\n"


class ToolCallStream:
    """Reads an answer's text deltas: passes the content on, holding back only what may be the
    start of the calls' marker, and streams each call as OpenAI does: a first delta with its id
    and name once the name is complete, then its arguments as they come. What may still turn out
    to be the call's end (its marker's start, trailing blanks, V3's closing fence) is held back,
    so the pieces sent add up to the whole answer's arguments. A call cut short (max_tokens) keeps
    what was written; finish_reason "length" tells it."""

    def __init__(self):
        self.buffer = ""
        # content; calls (between calls); name; skip (a call without a name, to its end);
        # open (before the arguments: blanks, V3's ```json line); args
        self.state = "content"
        self.num_calls = 0
        self.v3 = False  # the call being read is in DeepSeek-V3's form

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now, each with its "index")."""
        self.buffer += delta
        content, out = "", []
        while True:
            b, state = self.buffer, self.state
            if state == "content":
                start = b.find(CALLS_BEGIN)
                if start < 0:
                    keep = marker_prefix_len(b, CALLS_BEGIN)
                    content, self.buffer = content + b[:len(b) - keep], b[len(b) - keep:]
                    return content, out
                content, self.buffer, self.state = content + b[:start], b[start + len(CALLS_BEGIN):], "calls"
            elif state == "calls":
                start = b.find(CALL_BEGIN)
                if start < 0:
                    self.buffer = b[len(b) - marker_prefix_len(b, CALL_BEGIN):]
                    return content, out
                self.buffer, self.state = b[start + len(CALL_BEGIN):], "name"
            elif state == "name":
                if not self._read_name(out):
                    return content, out
            elif state == "skip":
                end = b.find(CALL_END)
                if end < 0:
                    return content, out
                self.buffer, self.state = b[end + len(CALL_END):], "calls"
            elif state == "open":
                rest = b.lstrip(_BLANKS)
                if not rest:
                    self.buffer = ""
                    return content, out
                if self.v3 and (rest.startswith(_FENCE) or _FENCE.startswith(rest)):
                    line = rest.find("\n")  # the opening fence's line (```json) is not the arguments
                    if line < 0:
                        return content, out
                    rest = rest[line + 1:]
                self.buffer, self.state = rest, "args"
            else:  # args
                end = b.find(CALL_END)
                if end >= 0:
                    out += self._arguments(self._trim_end(b[:end]))
                    self.buffer, self.state = b[end + len(CALL_END):], "calls"
                    continue
                body = b[:len(b) - marker_prefix_len(b, CALL_END)]
                send = body.rstrip(_BLANKS + ("`" if self.v3 else ""))
                out += self._arguments(send)
                self.buffer = b[len(send):]
                return content, out

    def finish(self) -> tuple[str, list[dict]]:
        """What is still held back when the answer ends: content (a marker's start that was not
        one), or the end of the call being written."""
        rest, out = "", []
        if self.state == "content":
            rest = self.buffer
        elif self.state == "args":
            out = self._arguments(self._trim_end(self.buffer))
        self.buffer, self.state = "", "calls"
        return rest, out

    def _read_name(self, out: list[dict]) -> bool:
        """In a call, before its separator: read the name and open the call; False: more text needed."""
        b = self.buffer
        sep, end = b.find(CALL_SEP), b.find(CALL_END)
        if end >= 0 and (sep < 0 or end < sep):  # no separator: not a call anyone could run
            self.buffer, self.state = b[end + len(CALL_END):], "calls"
            return True
        if sep < 0:
            return False
        name, rest = b[:sep].strip(), b[sep + len(CALL_SEP):]
        self.v3 = name == "function"  # DeepSeek-V3's form: the name on the first line, then a JSON block
        if self.v3:
            line = rest.find("\n")
            if line < 0:
                return False
            name, rest = rest[:line].strip(), rest[line + 1:]
        if not name:
            self.buffer, self.state = rest, "skip"
            return True
        out.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": name, "arguments": ""}})
        self.num_calls += 1
        self.buffer, self.state = rest, "open"
        return True

    def _trim_end(self, text: str) -> str:
        """A call's last arguments, its end known: no trailing blanks, nor V3's closing fence."""
        text = text.rstrip(_BLANKS)
        return text.removesuffix(_FENCE).rstrip(_BLANKS) if self.v3 else text

    def _arguments(self, text: str) -> list[dict]:
        return [{"index": self.num_calls - 1, "function": {"arguments": text}}] if text else []


def marker_prefix_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
