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
                 rank_options: list[dict] | None = None, max_sessions: int = 100_000, eplb: dict | None = None,
                 expert_parallel: bool = True):
        options = rank_options or [{"num_cpus": 0, "num_gpus": 0}] * dp_size
        self.ranks = [
            DecodeRank.options(**options[r]).remote(r, model_path, engine_cfg, device, prefill_handle,
                                                    local_prefill_max_tokens, transfer_timeout_s)
            for r in range(dp_size)]
        eplb = eplb or {}
        ep = self._expert_parallel(model_path, dp_size, device, eplb) if dp_size > 1 and expert_parallel else None
        info = ray.get([rank.start.remote(ep) for rank in self.ranks])
        self.controller = None
        if ep is not None and eplb.get("enabled", True):
            self.controller = self._start_controller(model_path, ep, eplb, engine_cfg)
        self.max_model_len = min(i["max_model_len"] for i in info)
        self.running = [0] * dp_size
        self.session_affinity = session_affinity
        self.saturated_at = max_running_per_rank
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()

    def _expert_parallel(self, model_path: str, dp_size: int, device: str, eplb: dict) -> dict:
        from engine.config import ModelConfig

        cfg = ModelConfig.from_file(model_path)
        num_slots = cfg.n_routed_experts + eplb.get("redundant_experts", 0)
        if num_slots % dp_size:
            raise ValueError(f"{cfg.n_routed_experts} experts + eplb.redundant_experts "
                             f"{eplb.get('redundant_experts', 0)} = {num_slots} slots do not split over "
                             f"decode.dp_size {dp_size} ranks")
        addr, port = ray.get(self.ranks[0].endpoint.remote())
        return {"addr": addr, "port": port, "world": dp_size, "num_slots": num_slots,
                "backend": "nccl" if device == "cuda" else "gloo"}

    def _start_controller(self, model_path: str, ep: dict, eplb: dict, engine_cfg: dict):
        import torch

        from engine.config import ModelConfig
        from engine.ep import initial_placement

        from .eplb_controller import EPLBController

        cfg = ModelConfig.from_file(model_path)
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        elem = torch.finfo(getattr(torch, engine_cfg.get("dtype", "float32"))).bits // 8
        controller = EPLBController.options(num_cpus=0).remote(
            self.ranks, initial_placement(layers, cfg.n_routed_experts, ep["num_slots"]).tolist(),
            cfg.n_routed_experts, num_groups=cfg.n_group, interval_s=eplb.get("interval_s", 30.0),
            min_gain=eplb.get("min_gain", 0.05), stage_timeout_s=eplb.get("stage_timeout_s", 30.0),
            bytes_per_expert=3 * cfg.hidden_size * cfg.moe_intermediate_size * elem)
        ray.get(controller.start.remote())
        return controller

    async def rebalance(self, force: bool = True, stage_delay_s: float = 0.0) -> dict:
        """Re-place experts now (by hand); returns the round's report."""
        if self.controller is None:
            return {"action": "unavailable", "reason": "no expert parallelism or EPLB in this group"}
        return await self.controller.rebalance.remote(force, stage_delay_s)

    async def migrate_to(self, phys2log: list, stage_delay_s: float = 0.0) -> dict:
        """Move to a given expert placement [moe_layers][slots] (pinning experts by hand)."""
        if self.controller is None:
            return {"action": "unavailable", "reason": "no expert parallelism or EPLB in this group"}
        return await self.controller.migrate_to.remote(phys2log, stage_delay_s)

    async def ep_status(self) -> list[dict]:
        return await asyncio.gather(*[rank.ep_status.remote() for rank in self.ranks])

    async def eplb_status(self) -> dict | None:
        return await self.controller.status.remote() if self.controller is not None else None

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
