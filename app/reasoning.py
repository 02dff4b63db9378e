"""A reasoning model's thinking, split from its answer: whole, or as it streams.

DeepSeek-R1 and DeepSeek-V3.1 in thinking mode write their reasoning first and close it with
</think>; the chat template has already opened it (the generation prompt ends with <think>), so
the answer's text starts inside the reasoning. Older R1 checkpoints open it themselves: a leading
<think> is dropped. The parsers, named as vLLM names them (a deployment's `model.reasoning_parser`):

- "deepseek_r1": every answer starts in its reasoning.
- "deepseek_v3": V3.1 thinks only when the request asks for it with
  `chat_template_kwargs: {"thinking": true}`; otherwise the whole answer is content.

An answer cut short (max_tokens) before </think> is all reasoning and no content, as in vLLM.
"""
from __future__ import annotations

from engine.tokenizer import THINK_BEGIN, THINK_END

from .tool_calls import marker_prefix_len

PARSERS = ("deepseek_r1", "deepseek_v3")


def starts_in_reasoning(parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """Whether a chat answer's text begins inside its reasoning, for this deployment's parser."""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        return bool((chat_template_kwargs or {}).get("thinking"))
    return False


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, content) of an answer that starts inside its reasoning."""
    stream = ReasoningStream()
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    return reasoning + rest_reasoning, content + rest_content


def reasoning_tokens(pieces: list[str], tokens: list[int]) -> int:
    """How many of an answer's tokens were spent thinking: `tokens[i]` tokens made text piece i,
    and a piece counts while the answer is still inside its reasoning (the one closing it too)."""
    stream, spent = ReasoningStream(), 0
    for piece, n in zip(pieces, tokens):
        if stream.in_reasoning:
            spent += n
        stream.feed(piece)
    return spent


class ReasoningStream:
    """Reads the text deltas of an answer that starts inside its reasoning: passes the reasoning
    on, holding back only what may be the start of </think> (or of a leading <think>), then
    passes everything after </think> on as content."""

    def __init__(self):
        self.buffer = ""
        self.in_reasoning = True
        self.at_start = True  # a leading <think> may still come

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning to send now, content to send now)."""
        if not self.in_reasoning:
            return "", delta
        self.buffer += delta
        if self.at_start:
            if THINK_BEGIN.startswith(self.buffer):
                return "", ""  # may still be the leading <think>
            self.buffer = self.buffer.removeprefix(THINK_BEGIN)
            self.at_start = False
        end = self.buffer.find(THINK_END)
        if end >= 0:
            reasoning, content = self.buffer[:end], self.buffer[end + len(THINK_END):]
            self.buffer, self.in_reasoning = "", False
            return reasoning, content
        keep = marker_prefix_len(self.buffer, THINK_END)
        reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What is still held back at the end of the answer: reasoning (a marker's start that was not one)."""
        rest, self.buffer = self.buffer, ""
        if self.at_start and rest == THINK_BEGIN:
            rest = ""
        return rest, ""
