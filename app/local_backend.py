"""The HTTP app's backend on an in-process engine: tests and the single-process mode."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine.async_engine import AsyncLLMEngine
from engine.sampling import SamplingParams


class LocalBackend:
    def __init__(self, async_engine: AsyncLLMEngine, model_name: str):
        self.async_engine = async_engine
        self.model_name = model_name
        self.max_model_len = async_engine.engine.max_model_len

    async def generate(self, request: dict, session_id: str | None) -> AsyncIterator[dict]:
        # one engine has no placement to choose, so the session id has nothing to steer here
        params = SamplingParams(**request["sampling"])
        prompt = request.get("prompt")
        if prompt is None:
            prompt = request.get("prompt_token_ids")
        outputs = self.async_engine.generate(request["request_id"], prompt, params, messages=request.get("messages"),
                                              tools=request.get("tools"),
                                              chat_template_kwargs=request.get("chat_template_kwargs"))
        try:
            async for out in outputs:
                yield out.stream_dict()
        finally:
            # closing the engine's stream before it finished is what aborts the request there
            await outputs.aclose()

    async def tokenize(self, request: dict) -> dict:
        return await asyncio.to_thread(self.async_engine.engine.tokenize, request)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.async_engine.engine.detokenize, token_ids)

    async def health(self) -> dict:
        # stats() waits for the engine lock, held for a whole step: keep it off the event loop
        stats = await asyncio.to_thread(self.async_engine.stats)
        dead = self.async_engine.dead
        if dead is not None:
            raise RuntimeError(f"engine loop stopped: {dead!r}")
        return {"model": self.model_name, **stats}
