"""Ingress: the OpenAI HTTP API, and the same endpoints as Python handle methods for agent
frameworks, in front of the decode group. The logic lives in app/service.py and app/http.py;
this wraps it for Serve."""
from __future__ import annotations

import os
from typing import AsyncIterator

from ray import serve
from ray.exceptions import RayTaskError

from app.service import OpenAIService
from engine.errors import Overloaded, RequestError
from engine.sampling import SamplingError


class ServeBackend:
    """The HTTP app's backend: the decode group's streaming `generate`, through a handle."""

    def __init__(self, decode_handle, model_name: str, max_model_len: int, capacity: int | None = None):
        self.decode = decode_handle.options(stream=True)
        self.info = decode_handle.info
        self.group = decode_handle
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.capacity = capacity
        self.inflight = 0

    async def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]:
        # Shed here, before any hop: under overload the answer must come fast (the decode group
        # checks again for callers that reach it through a handle).
        if self.capacity is not None and self.inflight >= self.capacity:
            raise Overloaded(f"{self.inflight} requests in flight (capacity {self.capacity})", retry_after_s=1.0)
        self.inflight += 1
        stream = self.decode.generate.remote(request, session_id=session_id)
        try:
            async for out in stream:
                yield out
        except RayTaskError as e:
            # A bad request raised in a rank reaches us wrapped; give the HTTP layer the original.
            if isinstance(e.cause, (RequestError, SamplingError, Overloaded)):
                raise e.cause from None
            raise
        finally:
            self.inflight -= 1
            stream.cancel()  # a no-op once finished; aborts the request upstream otherwise

    async def tokenize(self, request: dict) -> dict:
        return await self._unwrapped(self.group.tokenize.remote(request))

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._unwrapped(self.group.detokenize.remote(token_ids))

    @staticmethod
    async def _unwrapped(response):
        try:
            return await response
        except RayTaskError as e:  # a bad request raised in a rank: the original, for the HTTP layer
            if isinstance(e.cause, (RequestError, SamplingError)):
                raise e.cause from None
            raise

    async def health(self) -> dict:
        return {"model": self.model_name, **await self.info.remote()}


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """HTTP: POST /v1/chat/completions, POST /v1/completions, POST /tokenize, POST /detokenize,
    GET /v1/models, GET /health.

    Python (agent frameworks in the same Ray cluster)::

        handle = serve.get_app_handle("wideep")
        reply = await handle.chat.remote({"messages": [...], "max_tokens": 64}, session_id="agent-7")
        async for chunk in handle.options(stream=True).chat_stream.remote(request, session_id="agent-7"):
            ...
    Requests are OpenAI request bodies (dicts, or app.openai_api request models); replies are
    OpenAI response / chunk objects as dicts. Bad requests raise app.openai_api.APIError with
    the HTTP status it would have had.
    """

    def __init__(self, decode_handle, model_name: str, max_model_len: int, routing: dict, http: dict,
                 capacity: int | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str = "deepseek_v31"):
        self.backend = ServeBackend(decode_handle, model_name, max_model_len, capacity)
        self.reasoning_parser, self.tool_call_parser = reasoning_parser, tool_call_parser
        self.service = OpenAIService(self.backend, http.get("max_tokens_limit"), reasoning_parser, tool_call_parser)
        self.routing = routing
        self.http = http

    def __serve_build_asgi_app__(self):
        from app.http import build_http_app

        api_key = os.environ.get(self.http["api_key_env"]) if self.http.get("api_key_env") else None
        if self.http.get("api_key_env") and not api_key:
            raise RuntimeError(f"http.api_key_env names {self.http['api_key_env']!r}, which is not set")
        return build_http_app(self.backend, session_header=self.routing["session_header"],
                              max_body_bytes=self.http["max_body_bytes"],
                              max_tokens_limit=self.http.get("max_tokens_limit"), api_key=api_key,
                              reasoning_parser=self.reasoning_parser, tool_call_parser=self.tool_call_parser)

    async def chat(self, request, session_id: str | None = None) -> dict:
        """A chat completion (non-streaming)."""
        return await self._complete("chat", request, session_id)

    async def completions(self, request, session_id: str | None = None) -> dict:
        """A legacy text completion (non-streaming)."""
        return await self._complete("completion", request, session_id)

    async def chat_stream(self, request, session_id: str | None = None) -> AsyncIterator[dict]:
        """Chat completion chunks; call through `handle.options(stream=True)`."""
        async for chunk in self._stream("chat", request, session_id):
            yield chunk

    async def completions_stream(self, request, session_id: str | None = None) -> AsyncIterator[dict]:
        """Text completion chunks; call through `handle.options(stream=True)`."""
        async for chunk in self._stream("completion", request, session_id):
            yield chunk

    async def tokenize(self, request) -> dict:
        """vLLM's /tokenize: {"prompt"} or {"messages", "tools", ...} -> {"count", "tokens", ...}."""
        return await self.service.tokenize(request)

    async def detokenize(self, request) -> dict:
        """vLLM's /detokenize: {"tokens"} -> {"prompt"}."""
        return await self.service.detokenize(request)

    async def _complete(self, kind: str, request, session_id: str | None) -> dict:
        req, engine_request = self.service.parse(kind, request)
        stream, first = await self.service.open(kind, engine_request, _session(req, session_id))
        return await self.service.collect(kind, req, engine_request, stream, first)

    async def _stream(self, kind: str, request, session_id: str | None) -> AsyncIterator[dict]:
        req, engine_request = self.service.parse(kind, request)
        stream, first = await self.service.open(kind, engine_request, _session(req, session_id))
        async for chunk in self.service.chunks(kind, req, engine_request, stream, first):
            yield chunk


def _session(req, session_id: str | None) -> str | None:
    """The handle argument wins, then OpenAI's `user`, then the `session_id` extension field."""
    return session_id or getattr(req, "user", None) or getattr(req, "session_id", None)
