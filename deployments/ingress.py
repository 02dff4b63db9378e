"""Ingress: the OpenAI HTTP API (and a Python handle API for agent frameworks) in front of
the decode group. The HTTP layer itself lives in app/http.py; this wraps it for Serve."""
from __future__ import annotations

import os
from typing import AsyncIterator

from ray import serve
from ray.exceptions import RayTaskError

from engine.llm_engine import RequestError
from engine.sampling import SamplingError


class ServeBackend:
    """The HTTP app's backend: the decode group's streaming `generate`, through a handle."""

    def __init__(self, decode_handle, model_name: str, max_model_len: int):
        self.decode = decode_handle.options(stream=True)
        self.info = decode_handle.info
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]:
        stream = self.decode.generate.remote(request, session_id=session_id)
        try:
            async for out in stream:
                yield out
        except RayTaskError as e:
            # A bad request raised in a rank reaches us wrapped; give the HTTP layer the original.
            if isinstance(e.cause, (RequestError, SamplingError)):
                raise e.cause from None
            raise
        finally:
            stream.cancel()

    async def health(self) -> dict:
        return {"model": self.model_name, **await self.info.remote()}


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    def __init__(self, decode_handle, model_name: str, max_model_len: int, routing: dict, http: dict):
        self.backend = ServeBackend(decode_handle, model_name, max_model_len)
        self.routing = routing
        self.http = http

    def __serve_build_asgi_app__(self):
        from app.http import build_http_app

        api_key = os.environ.get(self.http["api_key_env"]) if self.http.get("api_key_env") else None
        if self.http.get("api_key_env") and not api_key:
            raise RuntimeError(f"http.api_key_env names {self.http['api_key_env']!r}, which is not set")
        return build_http_app(self.backend, session_header=self.routing["session_header"],
                              max_body_bytes=self.http["max_body_bytes"],
                              max_tokens_limit=self.http.get("max_tokens_limit"), api_key=api_key)
