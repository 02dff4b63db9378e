"""OpenAI wire format, the answer's side: response, choice, logprobs and stream-chunk objects,
and the server-sent events that carry them. No I/O here; app/http.py does the serving."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal


def new_request_id(kind: Literal["chat", "completion"]) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """reasoning_tokens: of the completion's, those of a reasoning model's thinking (with a parser)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def completion_response(kind: Literal["chat", "completion"], request_id: str, model: str, created: int,
                        choices: list[dict], usage_obj: dict) -> dict:
    return {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage_obj}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """logprobs: the engine's records (engine/logprobs.py), one per generated token, when asked for;
    tool_calls: in the API's form (app/tool_calls.py), the content then being what came before them;
    reasoning: a reasoning model's thinking (app/reasoning.py), the content what came after it."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message.update(content=text or None, tool_calls=tool_calls)
    return {"index": index, "message": message, "logprobs": chat_logprobs(logprobs), "finish_reason": finish_reason}


def vllm_prompt_logprobs(records: list[dict], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: {logprob,
    rank, decoded_token}} for the token itself and its k most likely alternatives."""
    out: list[dict | None] = []
    for r in records:
        if r["logprob"] is None:
            out.append(None)
            continue
        entry = {str(r["token_id"]): {"logprob": r["logprob"], "rank": r["rank"], "decoded_token": r["token"]}}
        for rank, t in enumerate(r["top"][:k], 1):
            entry.setdefault(str(t["token_id"]), {"logprob": t["logprob"], "rank": rank, "decoded_token": t["token"]})
        out.append(entry)
    return out


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: list[dict] | None = None,
                text_offsets: list[int] | None = None) -> dict:
    """text_offsets: where each logprobs record's token starts in `text`."""
    return {"index": index, "text": text, "logprobs": completion_logprobs(logprobs, text_offsets),
            "finish_reason": finish_reason}


def chat_logprobs(records: list[dict] | None) -> dict | None:
    """Chat's form: a content list, each token with its text, UTF-8 bytes and top alternatives."""
    if records is None:
        return None
    return {"content": [dict(_chat_token(r), top_logprobs=[_chat_token(t) for t in r["top"]]) for r in records]}


def _chat_token(record: dict) -> dict:
    return {"token": record["token"], "logprob": record["logprob"], "bytes": list(record["token"].encode())}


def completion_logprobs(records: list[dict] | None, text_offsets: list[int] | None) -> dict | None:
    """The legacy form: parallel lists. Each top_logprobs map holds the alternatives and the
    sampled token, so up to logprobs + 1 entries, as OpenAI documents. An echoed prompt's first
    token has no log-probability: null in token_logprobs and top_logprobs."""
    if records is None:
        return None
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [None if r["logprob"] is None else
                             {**{t["token"]: t["logprob"] for t in r["top"]}, r["token"]: r["logprob"]}
                             for r in records],
            "text_offset": list(text_offsets or [])}


def prompt_offsets(records: list[dict], prompt_text: str) -> list[int]:
    """Where each token of an echoed prompt's logprob records (the engine's prompt_logprobs)
    starts in `prompt_text`: its tokens' texts added up (a token holding part of a multi-byte
    character shows as U+FFFD, so offsets past one are near, not exact), kept inside the text."""
    offsets, at = [], 0
    for r in records:
        offsets.append(min(at, len(prompt_text)))
        at += len(r["token"])
    return offsets


class StreamChunks:
    """Builds the SSE events of one streamed response, chat or legacy completion."""

    def __init__(self, kind: Literal["chat", "completion"], request_id: str, model: str,
                 include_usage: bool, created: int | None = None):
        self.kind = kind
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.created = created if created is not None else int(time.time())

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {"id": self.request_id, "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                 "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI sends null usage on every chunk but the last
        return chunk

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: list[dict] | None = None, text_offset: int | list[int] = 0,
                reasoning: str | None = None) -> dict:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not reasoning):
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                    "finish_reason": finish_reason}
        offsets = text_offset if isinstance(text_offset, list) else [text_offset] * len(logprobs or ())
        return {"index": index, "text": text or "", "logprobs": completion_logprobs(logprobs, offsets),
                "finish_reason": finish_reason}

    def role(self, index: int = 0) -> dict | None:
        """Chat streams open each choice with the assistant role and empty content."""
        return self._chunk([self._choice(index, "", None, role=True)]) if self.kind == "chat" else None

    def delta(self, text: str, logprobs: list[dict] | None = None, text_offset: int | list[int] = 0, index: int = 0,
              reasoning: str | None = None) -> dict:
        """logprobs: the records of this delta's tokens; text_offset: where they start in the
        choice's whole text (legacy completions; a list: each record's own); reasoning: a chat
        delta's reasoning text."""
        return self._chunk([self._choice(index, text, None, logprobs=logprobs, text_offset=text_offset,
                                         reasoning=reasoning)])

    def tool_calls(self, calls: list[dict], index: int = 0) -> dict:
        """A chat delta of tool-call pieces (each with its \"index\" in the answer: a call's first piece has
        its id, type and name, the others more of its arguments)."""
        return self._chunk([{"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}])

    def finish(self, finish_reason: str | None, index: int = 0) -> dict:
        return self._chunk([self._choice(index, None if self.kind == "chat" else "", finish_reason)])

    def usage(self, usage_obj: dict) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage_obj
        return chunk


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
