"""A decode group: one Serve replica that owns the group's DP rank actors.

Routing to the ranks follows `routing.policy` (deployments/rank_router.py): by default a
session stays on its rank until that rank is saturated, so its next turn finds its prefix in
that rank's cache; a request without a session goes where the last request with the same
system prompt and first turn went (prefix-aware), else to the rank with the fewest running
requests. The `least_loaded`, `power_of_two` and `random` policies bind nothing.

Admission is bounded (beyond `max_requests_per_rank` per rank a request gets Overloaded at
once). A rank that dies is noticed by the request streams and by a watchdog; the group is
rebuilt (with expert parallelism every rank steps in lockstep, so all ranks restart) and
each interrupted request is retried on the new ranks from its prompt plus the tokens it had
already produced, or ends with a clear error.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray import serve
from ray.exceptions import GetTimeoutError, RayActorError

from engine.errors import Overloaded

from .decode_rank import DecodeRank
from .rank_router import RankRouter

log = logging.getLogger(__name__)
MAX_RETRIES = 2


@serve.deployment(name="DecodeGroup")
class DecodeGroup:
    def __init__(self, model_path: str, engine_cfg: dict, dp_size: int, device: str, prefill_handle=None,
                 routing_policy: str = "session_affinity", max_running_per_rank: int = 64,
                 local_prefill_max_tokens: int = 256, transfer_timeout_s: float = 30.0,
                 rank_placement: dict | None = None, max_sessions: int = 100_000, eplb: dict | None = None,
                 expert_parallel: bool = True, max_requests_per_rank: int = 256, token_timeout_s: float = 120.0,
                 kv_transport: str = "nixl", prefix_aware: bool = True):
        self.model_path, self.engine_cfg, self.device = model_path, engine_cfg, device
        self.kv_transport = kv_transport
        self.dp_size, self.prefill_handle = dp_size, prefill_handle
        self.local_prefill_max_tokens, self.transfer_timeout_s = local_prefill_max_tokens, transfer_timeout_s
        if rank_placement is not None:  # GPU: this replica reserves (and owns) its ranks' placement group
            from placement.ray_groups import group_rank_options
            self.rank_options = group_rank_options(**rank_placement)
        else:
            self.rank_options = [{"num_cpus": 0, "num_gpus": 0}] * dp_size
        self.eplb = eplb or {}
        self.expert_parallel = expert_parallel and dp_size > 1
        self.router = RankRouter(routing_policy, max_running_per_rank, max_sessions, prefix_aware)
        self.capacity = max_requests_per_rank * dp_size
        self.token_timeout_s = token_timeout_s
        self.generation = 0
        self.recoveries: list[dict] = []
        self._rebuild_lock = asyncio.Lock()
        self._watchdog = None
        info = ray.get(self._launch())
        self.max_model_len = min(i["max_model_len"] for i in info)
        self._start_controller_sync()

    # building the ranks ---------------------------------------------------------------------
    def _launch(self) -> list:
        """Create the rank actors and start them; returns the start refs (every rank must be
        starting at once: they meet in torch.distributed's rendezvous)."""
        self.ranks = [
            DecodeRank.options(**self.rank_options[r]).remote(
                r, self.model_path, self.engine_cfg, self.device, self.prefill_handle,
                self.local_prefill_max_tokens, self.transfer_timeout_s, self.kv_transport)
            for r in range(self.dp_size)]
        self.running = [0] * self.dp_size
        self.ep = self._expert_parallel() if self.expert_parallel else None
        self.controller = None
        return [rank.start.remote(self.ep) for rank in self.ranks]

    def _expert_parallel(self) -> dict:
        from engine.config import ModelConfig

        cfg = ModelConfig.from_file(self.model_path)
        num_slots = cfg.n_routed_experts + self.eplb.get("redundant_experts", 0)
        if num_slots % self.dp_size:
            raise ValueError(f"{cfg.n_routed_experts} experts + eplb.redundant_experts "
                             f"{self.eplb.get('redundant_experts', 0)} = {num_slots} slots do not split over "
                             f"decode.dp_size {self.dp_size} ranks")
        addr, port = ray.get(self.ranks[0].endpoint.remote())
        return {"addr": addr, "port": port, "world": self.dp_size, "num_slots": num_slots,
                "backend": "nccl" if self.device == "cuda" else "gloo"}

    def _controller_actor(self):
        if self.ep is None or not self.eplb.get("enabled", True):
            return None
        import torch

        from engine.config import ModelConfig
        from engine.ep import initial_placement

        from .eplb_controller import EPLBController

        cfg = ModelConfig.from_file(self.model_path)
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        elem = torch.finfo(getattr(torch, self.engine_cfg.get("dtype", "float32"))).bits // 8
        return EPLBController.options(num_cpus=0).remote(
            self.ranks, initial_placement(layers, cfg.n_routed_experts, self.ep["num_slots"]).tolist(),
            cfg.n_routed_experts, num_groups=cfg.n_group, interval_s=self.eplb.get("interval_s", 30.0),
            min_gain=self.eplb.get("min_gain", 0.05), stage_timeout_s=self.eplb.get("stage_timeout_s", 30.0),
            bytes_per_expert=3 * cfg.hidden_size * cfg.moe_intermediate_size * elem)

    def _start_controller_sync(self) -> None:
        self.controller = self._controller_actor()
        if self.controller is not None:
            ray.get(self.controller.start.remote())

    async def _rebuild(self, seen_generation: int, why: str) -> None:
        """Replace every rank (once per failure, however many requests noticed it)."""
        async with self._rebuild_lock:
            if self.generation != seen_generation:
                return
            t0 = time.monotonic()
            log.warning("decode group rebuilding: %s", why)
            for actor in self.ranks + ([self.controller] if self.controller is not None else []):
                ray.kill(actor, no_restart=True)
            await asyncio.gather(*self._launch())
            self.controller = self._controller_actor()
            if self.controller is not None:
                await self.controller.start.remote()
            self.router.clear()
            self.generation += 1
            self.recoveries.append({"why": why, "seconds": time.monotonic() - t0})

    def _ensure_watchdog(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self, period_s: float = 1.0) -> None:
        """A rank can die with no request on it while the others wait for it in a collective:
        ping them all, and rebuild when one is gone."""
        while True:
            await asyncio.sleep(period_s)
            generation = self.generation
            try:
                await asyncio.wait_for(asyncio.gather(*[r.ping.remote() for r in self.ranks]), 30)
            except (RayActorError, asyncio.TimeoutError) as e:
                await self._rebuild(generation, f"watchdog: {type(e).__name__}")
            except Exception:
                log.exception("decode group watchdog")

    # routing ----------------------------------------------------------------------------
    def pick_rank(self, session_id: str | None, request: dict | None = None) -> int:
        return self.router.pick(self.running, session_id, request)

    async def generate(self, request: dict, session_id: str | None = None):
        """Streams the rank's per-token dicts, each tagged with the rank that served it."""
        self._ensure_watchdog()
        if sum(self.running) >= self.capacity:
            raise Overloaded(f"all {self.dp_size} decode ranks are full ({self.capacity} requests admitted)",
                             retry_after_s=1.0)
        sampling = dict(request.get("sampling", {}))
        max_tokens = sampling.get("max_tokens", 16)
        prompt_ids, produced, attempt = None, [], 0
        current = request
        while True:
            rank, generation = self.pick_rank(session_id, request), self.generation
            self.running[rank] += 1
            stream = self.ranks[rank].generate.options(num_returns="streaming").remote(current, session_id)
            try:
                async for ref in stream:
                    out = await asyncio.wait_for(ref, self.token_timeout_s)
                    if prompt_ids is None and out.get("prompt_token_ids") is not None:
                        prompt_ids = out["prompt_token_ids"]
                    produced += out["new_token_ids"]
                    if attempt:  # usage counts the original prompt, not the retry's longer one
                        out["num_prompt_tokens"] = len(prompt_ids)
                    yield dict(out, rank=rank)
                return
            except (RayActorError, GetTimeoutError, asyncio.TimeoutError) as e:
                attempt += 1
                why = f"rank {rank}: {type(e).__name__}"
                if attempt > MAX_RETRIES:
                    yield _failed(f"decode failed after {MAX_RETRIES} retries ({why})", prompt_ids, rank)
                    return
                await self._rebuild(generation, why)
                left = max_tokens - len(produced)
                if left <= 0:
                    yield dict(_failed(None, prompt_ids, rank), finish_reason="length", error=None)
                    return
                current = dict(request, request_id=f"{request['request_id']}:retry{attempt}",
                               sampling=dict(sampling, max_tokens=left))
                if prompt_ids is not None:  # continue from the tokens the client already has
                    current.update(prompt=None, messages=None, prompt_token_ids=prompt_ids + produced,
                                   prior_output_ids=list(produced))
                    # the first output carried the prompt's records and text: not again
                    current["sampling"].update(prompt_logprobs=None, echo=False)
            finally:
                if generation == self.generation:
                    self.running[rank] -= 1
                # The client went away (or the rank failed): stop the rank's request so its blocks free.
                try:
                    ray.cancel(stream)
                except Exception:  # the rank is already gone
                    pass

    # operator tools -----------------------------------------------------------------------
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

    def _least_busy(self):
        return self.ranks[min(range(len(self.ranks)), key=lambda r: self.running[r])]

    async def tokenize(self, request: dict) -> dict:
        """A prompt's (or messages') token ids, as a rank's engine makes them."""
        return await self._least_busy().tokenize.remote(request)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._least_busy().detokenize.remote(token_ids)

    async def stats(self) -> list[dict]:
        return await asyncio.gather(*[rank.stats.remote() for rank in self.ranks])

    def rank_actors(self) -> list:
        """The rank actors (for operators and fault drills)."""
        return list(self.ranks)

    def info(self) -> dict:
        return {"dp_size": len(self.ranks), "max_model_len": self.max_model_len, "running": list(self.running),
                "policy": self.router.policy, "sessions": len(self.router), "generation": self.generation,
                "recoveries": list(self.recoveries)}


def _failed(error: str | None, prompt_ids, rank: int) -> dict:
    return {"text_delta": "", "new_token_ids": [], "finished": True, "finish_reason": "error", "error": error,
            "num_prompt_tokens": len(prompt_ids or []), "num_cached_tokens": 0, "rank": rank}
