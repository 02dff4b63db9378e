"""Closed-loop replay over the OpenAI HTTP API: concurrency = live sessions.

`concurrency` workers each take the next session and send its turns in order, streaming,
with the session id in the `x-session-id` header, sleeping the trace's think time before
every turn after the first. A session starts only when a worker is free, so the offered load
follows the server (closed loop), as in AgentX.

Every replay of a session is made unique (see `_Replay`): the same trace can run at several
concurrencies, or recycle its sessions, without one replay warming the cache for another.
"""
from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid

import httpx2
from tqdm import tqdm

from .traces import synthesise_prompt
from .workload import Request


class _Replay:
    """One replay of one trace session: fresh session id, fresh first-turn marker."""

    def __init__(self, session: list[Request], level_tag: str, k: int):
        self.requests = session
        self.k = k
        self.session_id = f"{session[0].session_id}.{level_tag}.r{k}"
        self.level_tag = level_tag
        # chat: the system prompt stays shared by this level's sessions (as in production),
        # and the nonce in the first user message separates the replays of one session
        self.nonce = session[0].nonce
        self.salt = level_tag if k == 0 else f"{level_tag}/r{k}"

    def body(self, req: Request, model: str, vocab_size: int | None) -> tuple[str, dict]:
        common = {"model": model, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
        if req.api == "chat":
            msgs = copy.deepcopy(req.messages)
            msgs[0]["content"] = f"[run {self.level_tag}] " + msgs[0]["content"]
            if self.nonce:
                for m in msgs:
                    m["content"] = m["content"].replace(self.nonce, f"{self.nonce}.{self.level_tag}.r{self.k}")
            return "/v1/chat/completions", {**common, "messages": msgs}
        if vocab_size is None:
            raise ValueError("hash-id traces need the model's vocabulary size (--vocab-size)")
        return "/v1/completions", {**common, "prompt": synthesise_prompt(req, vocab_size, self.salt)}


async def _one(client: httpx2.AsyncClient, path: str, body: dict, session_id: str) -> dict:
    """Send one streaming request; timings are seconds from the send."""
    t0 = time.perf_counter()
    stamps, usage, error, status = [], None, None, None
    try:
        async with client.stream("POST", path, json=body, headers={"x-session-id": session_id}) as r:
            status = r.status_code
            if status != 200:
                text = (await r.aread()).decode(errors="replace")
                error = f"HTTP {status}: {text[:300]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                        # only chunks that carry text mark a token's arrival (the role chunk does not)
                        if piece:
                            stamps.append(time.perf_counter() - t0)
    except (httpx2.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter() - t0
    if error is None and usage is None:
        error = "the stream ended without a usage chunk"
    # text_chunks: how many arrivals were stamped. Fewer than the usage's output tokens means
    # some tokens streamed no text (or several came in one chunk): TTFT is then late or
    # missing, and the ITL samples are gaps between text chunks, not between tokens.
    rec = {"ok": error is None, "error": error, "status": status, "e2e_s": end,
           "ttft_s": stamps[0] if stamps else None, "itl_s": [b - a for a, b in zip(stamps, stamps[1:])],
           "text_chunks": len(stamps)}
    if usage:
        prompt = usage.get("prompt_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec.update(prompt_tokens=prompt, cached_tokens=cached, uncached_tokens=prompt - cached,
                   output_tokens=usage.get("completion_tokens", 0))
    return rec


async def _session(client, replay: _Replay, model: str, vocab_size, think_scale: float, level_start: float,
                   records: list, bar) -> None:
    prev_prompt = None
    for req in replay.requests:
        if req.turn > 0 and req.think_time_s > 0 and think_scale > 0:
            await asyncio.sleep(req.think_time_s * think_scale)
        path, body = replay.body(req, model, vocab_size)
        sent = time.perf_counter() - level_start
        rec = await _one(client, path, body, replay.session_id)
        shared = req.shared_prefix_tokens
        if shared is None:
            # chat: each prompt extends the previous one, and the chat template closes every
            # earlier turn with a special token, so the whole previous prompt is shared
            shared = 0 if req.turn == 0 else prev_prompt
        prev_prompt = rec.get("prompt_tokens") if rec["ok"] else None
        records.append({"session_id": replay.session_id, "turn": req.turn, "api": req.api,
                        "sent_s": sent, "max_tokens": req.max_tokens, "think_time_s": req.think_time_s,
                        "shared_prefix_tokens": shared, **rec})
        bar.update(1)


async def run_level(base_url: str, sessions: list[list[Request]], concurrency: int, num_sessions: int, *,
                    model: str, vocab_size: int | None = None, think_scale: float = 1.0,
                    timeout_s: float = 600.0, tag: str | None = None, progress: bool = True) -> dict:
    """Replay `num_sessions` sessions (the trace's, recycled when it holds fewer) with
    `concurrency` live at a time. Returns {concurrency, wall_s, records}."""
    if concurrency < 1 or num_sessions < 1:
        raise ValueError("concurrency and the number of sessions must be at least 1")
    if not sessions:
        raise ValueError("the trace holds no sessions")
    level_tag = tag or f"c{concurrency}-{uuid.uuid4().hex[:6]}"
    replays = [_Replay(sessions[i % len(sessions)], level_tag, i // len(sessions)) for i in range(num_sessions)]
    queue: asyncio.Queue = asyncio.Queue()
    for r in replays:
        queue.put_nowait(r)
    records: list[dict] = []
    total = sum(len(r.requests) for r in replays)
    limits = httpx2.Limits(max_connections=max(16, 2 * concurrency), max_keepalive_connections=max(16, concurrency))
    with tqdm(total=total, desc=f"concurrency {concurrency}", unit="req", disable=not progress) as bar:
        async with httpx2.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
            start = time.perf_counter()

            async def worker():
                while not queue.empty():
                    await _session(client, queue.get_nowait(), model, vocab_size, think_scale, start, records, bar)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, num_sessions))))
            wall = time.perf_counter() - start
    return {"concurrency": concurrency, "wall_s": wall, "records": records}


async def served_model(base_url: str) -> str:
    async with httpx2.AsyncClient(base_url=base_url, timeout=30) as client:
        r = await client.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]
