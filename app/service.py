"""The OpenAI endpoints' logic over a backend, shared by the HTTP routes (app/http.py) and the
Python handle API of the Serve ingress. Ray-free and transport-free.

Backend contract::

    model_name: str; max_model_len: int
    async def generate(request: dict, session_id: str | None) -> AsyncIterator[dict]
    async def health() -> dict

`request` holds request_id, prompt, prompt_token_ids, messages and sampling (SamplingParams
fields); each yielded dict holds text_delta, new_token_ids, finished, finish_reason,
num_prompt_tokens, num_cached_tokens and error.
"""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Literal, Protocol

import anyio
from pydantic import BaseModel

from engine.llm_engine import Overloaded, RequestError  # noqa: F401  (backends raise Overloaded)
from engine.sampling import SamplingError

from . import openai_api as oa
from .openai_api import APIError, bad_request

log = logging.getLogger(__name__)

Kind = Literal["chat", "completion"]


class Backend(Protocol):
    model_name: str
    max_model_len: int

    def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]: ...

    async def health(self) -> dict: ...


def is_context_length_error(exc: BaseException) -> bool:
    return getattr(exc, "code", None) == "context_length_exceeded"


def api_error_from(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """What a backend's exception means to the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), type="server_error", code="overloaded",
                        headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
    if is_context_length_error(exc):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, (SamplingError, RequestError)):
        return bad_request(str(exc))
    log.exception("backend failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")


def _usage(last: dict, completion_tokens: int) -> dict:
    return oa.usage(last.get("num_prompt_tokens", 0), completion_tokens, last.get("num_cached_tokens", 0))


def _wants_logprobs(engine_request: dict) -> bool:
    return engine_request.get("sampling", {}).get("logprobs") is not None


class OpenAIService:
    def __init__(self, backend: Backend, max_tokens_limit: int | None = None):
        self.backend = backend
        self.max_tokens_limit = max_tokens_limit

    # requests ---------------------------------------------------------------------------
    def parse(self, kind: Kind, body: Any) -> tuple[Any, dict]:
        """An OpenAI request body (dict or one of our request models) -> (request model,
        engine request). Every problem is an APIError (4xx)."""
        if isinstance(body, BaseModel):
            body = body.model_dump(exclude_unset=True)
        b = self.backend
        if kind == "chat":
            req = oa.parse_request(oa.ChatCompletionRequest, body)
            messages, text, token_ids = oa.chat_messages(req), None, None
            # chat has no default cap in OpenAI's API; the engine ends the answer at the context
            default_max = min(self.max_tokens_limit or b.max_model_len, b.max_model_len - 1)
        else:
            req = oa.parse_request(oa.CompletionRequest, body)
            messages, (text, token_ids) = None, oa.completion_prompt(req)
            default_max = min(oa.COMPLETIONS_DEFAULT_MAX_TOKENS, b.max_model_len - 1)
        if req.model is not None and req.model != b.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {b.model_name!r}",
                           param="model", code="model_not_found")
        params = oa.sampling_params(req, default_max_tokens=default_max, max_model_len=b.max_model_len,
                                    max_tokens_limit=self.max_tokens_limit)
        return req, {"request_id": oa.new_request_id(kind), "prompt": text, "prompt_token_ids": token_ids,
                     "messages": messages, "sampling": oa.sampling_dict(params)}

    # running ----------------------------------------------------------------------------
    async def open(self, kind: Kind, engine_request: dict, session_id: str | None
                   ) -> tuple[AsyncIterator[dict], dict]:
        """Starts the request and waits for its first output, so a rejected request is an
        APIError before any response byte goes out."""
        stream = self.backend.generate(engine_request, session_id)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the backend produced no output", type="server_error") from None
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            if isinstance(e, Exception):
                raise api_error_from(e, "messages" if kind == "chat" else "prompt") from None
            raise
        if first.get("error"):  # failed before any output: a server fault, answered as such
            await stream.aclose()
            log.error("request %s failed: %s", engine_request["request_id"], first["error"])
            raise APIError(500, f"generation failed: {first['error']}", type="server_error")
        return stream, first

    async def collect(self, kind: Kind, req, engine_request: dict, stream: AsyncIterator[dict],
                      first: dict) -> dict:
        """The whole (non-streaming) response object."""
        pieces, num_tokens, last = [], 0, {}
        logprobs: list[dict] | None = [] if _wants_logprobs(engine_request) else None
        offsets, text_len = [], 0
        try:
            out: dict | None = first
            while out is not None:
                if logprobs is not None and out.get("logprobs"):
                    logprobs += out["logprobs"]
                    offsets += [text_len] * len(out["logprobs"])
                pieces.append(out.get("text_delta", ""))
                text_len += len(pieces[-1])
                num_tokens += len(out.get("new_token_ids", ()))
                last = out
                if out.get("finished") or out.get("error"):
                    break
                out = await anext(stream, None)
        except Exception as e:
            raise api_error_from(e) from None
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        rid = engine_request["request_id"]
        if last.get("error"):
            log.error("request %s failed: %s", rid, last["error"])
            raise APIError(500, f"generation failed: {last['error']}", type="server_error")
        args = (rid, self.backend.model_name, int(time.time()), "".join(pieces), last.get("finish_reason"),
                _usage(last, num_tokens), logprobs)
        return oa.chat_completion(*args) if kind == "chat" else oa.text_completion(*args, offsets)

    async def chunks(self, kind: Kind, req, engine_request: dict, stream: AsyncIterator[dict],
                     first: dict) -> AsyncIterator[dict]:
        """The stream-chunk objects of a streaming response. A failure mid-stream ends it with
        an error object ({"error": ...}); the backend stream is closed however it ends."""
        chunks = oa.StreamChunks(kind, engine_request["request_id"], self.backend.model_name, req.include_usage)
        num_tokens, last, text_len = 0, first, 0
        try:
            role = chunks.role()
            if role is not None:
                yield role
            out: dict | None = first
            while out is not None:
                last = out
                if out.get("error"):
                    log.error("request %s failed mid-stream: %s", chunks.request_id, out["error"])
                    yield oa.error_body(f"generation failed: {out['error']}", "server_error")
                    return
                num_tokens += len(out.get("new_token_ids", ()))
                if out.get("text_delta") or out.get("logprobs"):
                    yield chunks.delta(out.get("text_delta", ""), out.get("logprobs"), text_len)
                    text_len += len(out.get("text_delta", ""))
                if out.get("finished"):
                    break
                out = await anext(stream, None)
            yield chunks.finish(last.get("finish_reason"))
            if chunks.include_usage:
                yield chunks.usage(_usage(last, num_tokens))
        except Exception as e:
            err = api_error_from(e)
            yield oa.error_body(err.message, err.type, None, err.code)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled response must still abort upstream
                await stream.aclose()
