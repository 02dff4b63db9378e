"""The OpenAI-compatible HTTP app (Starlette), in front of any backend with `generate` and
`health`. Ray-free: the Serve ingress deployment mounts the app this module builds.

Backend contract::

    model_name: str; max_model_len: int
    async def generate(request: dict, session_id: str | None) -> AsyncIterator[dict]
    async def health() -> dict

`request` holds request_id, prompt, prompt_token_ids, messages and sampling (SamplingParams
fields); each yielded dict holds text_delta, new_token_ids, finished, finish_reason,
num_prompt_tokens, num_cached_tokens and error.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.llm_engine import RequestError
from engine.sampling import SamplingError

from . import openai_api as oa
from .openai_api import APIError, bad_request

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The backend cannot take the request now; the client should retry after `retry_after_s`."""

    def __init__(self, message: str = "the server is overloaded; retry later", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Backend(Protocol):
    model_name: str
    max_model_len: int

    def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]: ...

    async def health(self) -> dict: ...


def pick_session_id(headers, body: dict, session_header: str) -> str | None:
    """The configured header wins, then OpenAI's `user`, then the `session_id` extension."""
    for candidate in (headers.get(session_header), body.get("user"), body.get("session_id")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return None


def is_context_length_error(exc: BaseException) -> bool:
    if getattr(exc, "code", None) == "context_length_exceeded":
        return True
    # the engine names the limit in its message; a typed error would be sturdier
    return isinstance(exc, RequestError) and "context limit" in str(exc)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def api_error_from(exc: BaseException, prompt_param: str | None = None) -> APIError:
    """What a backend's exception means to the client."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), type="server_error", code="overloaded",
                        headers={"Retry-After": str(max(1, round(exc.retry_after_s)))})
    if is_context_length_error(exc):
        return bad_request(str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, SamplingError):
        return bad_request(str(exc))
    if isinstance(exc, RequestError):
        return bad_request(str(exc))
    log.exception("backend failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error")


def build_http_app(backend: Backend, *, session_header: str = "x-session-id", max_body_bytes: int = 1_000_000,
                   max_tokens_limit: int | None = None, api_key: str | None = None) -> Starlette:
    expected_auth = f"Bearer {api_key}".encode() if api_key else None

    def check_auth(request: Request) -> None:
        if expected_auth is None:
            return
        given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        # constant-time, so the key cannot be guessed byte by byte from response timing
        if not hmac.compare_digest(given, expected_auth):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request("invalid Content-Length header")
            if int(declared) > max_body_bytes:
                raise _too_large(max_body_bytes)
        body = bytearray()
        try:
            # checked while reading too: a chunked body declares no length, and a declared one may lie
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_body_bytes:
                    raise _too_large(max_body_bytes)
        except ClientDisconnect:
            raise APIError(400, "client disconnected while sending the body") from None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad_request(f"the request body is not valid UTF-8 (byte {e.start})") from None
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        try:
            # "\ud800" escapes decode to lone surrogates that no tokenizer can take
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("the request body contains an unpaired UTF-16 surrogate escape") from None
        return value

    def check_model(req) -> None:
        if req.model is not None and req.model != backend.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                                f"{backend.model_name!r}", param="model", code="model_not_found")

    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        body = await read_json(request)
        req = oa.parse_request(oa.ChatCompletionRequest, body)
        check_model(req)
        messages = oa.chat_messages(req)
        # chat has no default cap in OpenAI's API; the engine ends the answer at the context
        default_max = min(max_tokens_limit or backend.max_model_len, backend.max_model_len - 1)
        params = oa.sampling_params(req, default_max_tokens=default_max,
                                    max_model_len=backend.max_model_len, max_tokens_limit=max_tokens_limit)
        engine_request = {"request_id": oa.new_request_id("chat"), "prompt": None, "prompt_token_ids": None,
                          "messages": messages, "sampling": oa.sampling_dict(params)}
        return await serve(request, "chat", req, engine_request, pick_session_id(request.headers, body, session_header))

    async def completions(request: Request) -> Response:
        check_auth(request)
        body = await read_json(request)
        req = oa.parse_request(oa.CompletionRequest, body)
        check_model(req)
        text, token_ids = oa.completion_prompt(req)
        default_max = min(oa.COMPLETIONS_DEFAULT_MAX_TOKENS, backend.max_model_len - 1)
        params = oa.sampling_params(req, default_max_tokens=default_max, max_model_len=backend.max_model_len,
                                    max_tokens_limit=max_tokens_limit)
        engine_request = {"request_id": oa.new_request_id("completion"), "prompt": text,
                          "prompt_token_ids": token_ids, "messages": None, "sampling": oa.sampling_dict(params)}
        return await serve(request, "completion", req, engine_request,
                           pick_session_id(request.headers, body, session_header))

    async def serve(request: Request, kind: str, req, engine_request: dict, session_id: str | None) -> Response:
        request_id = engine_request["request_id"]
        stream = backend.generate(engine_request, session_id)
        headers = {"x-request-id": request_id}
        try:
            if req.stream:
                # the first output is awaited before any byte is sent, so a rejected request
                # still gets a proper status code instead of an error inside a 200 stream
                first = await _unless_disconnected(request, stream.__anext__())
                if first.get("error"):
                    raise _GenerationFailed(first["error"])
                return _ClosingStreamingResponse(
                    _sse_events(stream, first, oa.StreamChunks(kind, request_id, backend.model_name, req.include_usage)),
                    media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
            result = await _unless_disconnected(request, _collect(stream))
        except _Disconnected:
            await stream.aclose()
            return Response(status_code=499)  # nobody is left to read it
        except StopAsyncIteration:
            raise APIError(500, "the backend produced no output", type="server_error") from None
        except _GenerationFailed as e:
            await stream.aclose()
            log.error("request %s failed: %s", request_id, e)
            raise APIError(500, f"generation failed: {e}", type="server_error") from None
        except Exception as e:
            await stream.aclose()
            raise api_error_from(e, "messages" if kind == "chat" else "prompt") from None
        text, last, num_tokens = result
        if last.get("error"):
            log.error("request %s failed: %s", request_id, last["error"])
            raise APIError(500, f"generation failed: {last['error']}", type="server_error")
        build = oa.chat_completion if kind == "chat" else oa.text_completion
        return JSONResponse(build(request_id, backend.model_name, int(time.time()), text, last.get("finish_reason"),
                                  _usage(last, num_tokens)), headers=headers)

    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [{
            "id": backend.model_name, "object": "model", "created": started, "owned_by": "wideep-serve",
            "max_model_len": backend.max_model_len}]})

    async def health(request: Request) -> Response:
        try:
            return JSONResponse({"status": "ok", **(await backend.health())})
        except Exception as e:
            log.warning("health check failed: %r", e)
            return JSONResponse({"status": "unhealthy", "error": f"{type(e).__name__}: {e}"}, status_code=503)

    started = int(time.time())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers: dict[Any, Callable] = {APIError: _on_api_error, HTTPException: _on_http_exception,
                                     Exception: _on_unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _usage(last: dict, completion_tokens: int) -> dict:
    return oa.usage(last.get("num_prompt_tokens", 0), completion_tokens, last.get("num_cached_tokens", 0))


async def _collect(stream: AsyncIterator[dict]) -> tuple[str, dict, int]:
    pieces, num_tokens, last = [], 0, {}
    async for out in stream:
        pieces.append(out.get("text_delta", ""))
        num_tokens += len(out.get("new_token_ids", ()))
        last = out
    return "".join(pieces), last, num_tokens


class _Disconnected(Exception):
    pass


class _GenerationFailed(Exception):
    """The backend reported a failed generation (a server fault, not a bad request)."""


async def _unless_disconnected(request: Request, work: Awaitable):
    """Runs `work`, giving up with _Disconnected as soon as the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise _Disconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # the body has been read, so the next message the server sends us is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse_events(stream: AsyncIterator[dict], first: dict, chunks: oa.StreamChunks) -> AsyncIterator[bytes]:
    num_tokens, last = 0, first
    try:
        role = chunks.role()
        if role is not None:
            yield role
        out: dict | None = first
        while out is not None:
            last = out
            if out.get("error"):
                log.error("request %s failed mid-stream: %s", chunks.request_id, out["error"])
                yield oa.sse_error(f"generation failed: {out['error']}")
                yield oa.SSE_DONE
                return
            num_tokens += len(out.get("new_token_ids", ()))
            if out.get("text_delta"):
                yield chunks.delta(out["text_delta"])
            if out.get("finished"):
                break
            out = await anext(stream, None)
        yield chunks.finish(last.get("finish_reason"))
        if chunks.include_usage:
            yield chunks.usage(_usage(last, num_tokens))
    except Exception as e:
        api_error = api_error_from(e)
        yield oa.sse_error(api_error.message, api_error.type, api_error.code)
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled response must still abort upstream
            await stream.aclose()
    yield oa.SSE_DONE


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the event generator however the response ends. A client that disconnects while
    the generator waits at a `yield` would otherwise leave it (and the request upstream) open
    until garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _on_api_error(request: Request, exc: APIError) -> Response:
    return error_response(exc)


async def _on_http_exception(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        err = APIError(404, f"no route {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                       code="method_not_allowed")
    else:
        err = APIError(exc.status_code, str(exc.detail))
    err.headers.update(exc.headers or {})
    return error_response(err)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))
