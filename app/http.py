"""The OpenAI-compatible HTTP app (Starlette): body limits, auth, client disconnects, SSE.
The endpoints' logic is app/service.py; the Serve ingress deployment mounts the app built here.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


from . import openai_api as oa
from . import openai_responses as responses
from .openai_api import APIError, bad_request
from .openapi import openapi_spec
from .service import Backend, OpenAIService

log = logging.getLogger(__name__)


def pick_session_id(headers, body: dict, session_header: str) -> str | None:
    """The configured header wins, then OpenAI's `user`, then the `session_id` extension."""
    for candidate in (headers.get(session_header), body.get("user"), body.get("session_id")):
        if isinstance(candidate, str) and candidate:
            return candidate
    return None


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def build_http_app(backend: Backend, *, session_header: str = "x-session-id", max_body_bytes: int = 1_000_000,
                   max_tokens_limit: int | None = None, api_key: str | None = None,
                   reasoning_parser: str | None = None, tool_call_parser: str = "deepseek_v31") -> Starlette:
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

    service = OpenAIService(backend, max_tokens_limit, reasoning_parser, tool_call_parser)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await handle(request, "completion")

    async def tokenize(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(await service.tokenize(await read_json(request)))

    async def detokenize(request: Request) -> Response:
        check_auth(request)
        return JSONResponse(await service.detokenize(await read_json(request)))

    async def handle(request: Request, kind: str) -> Response:
        check_auth(request)
        body = await read_json(request)
        req, engine_request = service.parse(kind, body)
        session_id = pick_session_id(request.headers, body, session_header)
        headers = {"x-request-id": engine_request["request_id"]}
        try:
            # the first output is awaited before any byte is sent, so a rejected request
            # still gets a proper status code instead of an error inside a 200 stream
            stream, first = await _unless_disconnected(request, service.open(kind, engine_request, session_id))
            if req.stream:
                events = _sse(service.chunks(kind, req, engine_request, stream, first))
                return _ClosingStreamingResponse(events, media_type="text/event-stream",
                                                 headers={**headers, "Cache-Control": "no-cache"})
            result = await _unless_disconnected(request, service.collect(kind, req, engine_request, stream, first))
        except _Disconnected:
            return Response(status_code=499)  # nobody is left to read it; the request was aborted
        return JSONResponse(result, headers=headers)

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

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_spec(backend.model_name, max_model_len=backend.max_model_len,
                                         max_tokens_limit=max_tokens_limit, max_body_bytes=max_body_bytes,
                                         auth=api_key is not None))

    started = int(time.time())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    handlers: dict[Any, Callable] = {APIError: _on_api_error, HTTPException: _on_http_exception,
                                     Exception: _on_unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


class _Disconnected(Exception):
    pass


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


async def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield responses.sse(chunk)
    finally:
        with anyio.CancelScope(shield=True):
            await chunks.aclose()
    yield responses.SSE_DONE


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
