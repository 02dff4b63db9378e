"""A decode group: one Serve replica that owns the group's DP rank actors.

New requests go to the rank with the fewest running requests (decode cost follows the
request count, not the context length). A session stays on its rank until that rank is
saturated, so its next turn finds its prefix in that rank's cache.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict

import ray
from ray import serve

from .decode_rank import DecodeRank


@serve.deployment(name="DecodeGroup")
class DecodeGroup:
    def __init__(self, model_path: str, engine_cfg: dict, dp_size: int, device: str, prefill_handle=None,
                 session_affinity: bool = True, max_running_per_rank: int = 64,
                 local_prefill_max_tokens: int = 256, transfer_timeout_s: float = 30.0,
                 rank_options: list[dict] | None = None, max_sessions: int = 100_000):
        options = rank_options or [{"num_cpus": 0, "num_gpus": 0}] * dp_size
        self.ranks = [
            DecodeRank.options(**options[r]).remote(r, model_path, engine_cfg, device, prefill_handle,
                                                    local_prefill_max_tokens, transfer_timeout_s)
            for r in range(dp_size)]
        info = ray.get([rank.ready.remote() for rank in self.ranks])
        self.max_model_len = min(i["max_model_len"] for i in info)
        self.running = [0] * dp_size
        self.session_affinity = session_affinity
        self.saturated_at = max_running_per_rank
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()

    def pick_rank(self, session_id: str | None) -> int:
        least = min(range(len(self.ranks)), key=lambda r: self.running[r])
        if not self.session_affinity or session_id is None:
            return least
        bound = self.sessions.get(session_id)
        rank = bound if bound is not None and self.running[bound] < self.saturated_at else least
        self.sessions[session_id] = rank
        self.sessions.move_to_end(session_id)
        if len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return rank

    async def generate(self, request: dict, session_id: str | None = None):
        """Streams the rank's per-token dicts, each tagged with the rank that served it."""
        rank = self.pick_rank(session_id)
        self.running[rank] += 1
        stream = self.ranks[rank].generate.options(num_returns="streaming").remote(request, session_id)
        try:
            async for ref in stream:
                yield dict(await ref, rank=rank)
        finally:
            self.running[rank] -= 1
            # The client went away (or the rank failed): stop the rank's request so its blocks free.
            ray.cancel(stream)

    async def stats(self) -> list[dict]:
        return await asyncio.gather(*[rank.stats.remote() for rank in self.ranks])

    def info(self) -> dict:
        return {"dp_size": len(self.ranks), "max_model_len": self.max_model_len, "running": list(self.running),
                "sessions": len(self.sessions)}
