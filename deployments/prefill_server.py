"""Prefill server: runs prompts and pushes their global KV into blocks a decode rank reserved.

An autoscaled Serve deployment; requests carry a session id so the session router keeps a
session's turns on the replica that already holds its prefix. A replica is one prefill
group: with `group_size` 1 its engine lives in the replica; with more, the replica owns
`group_size` rank actors (DP attention + EP MoE in lockstep, packed on one node) and hands
each prompt to the rank with the fewest in flight.
"""
from __future__ import annotations

import asyncio
import uuid

import ray
from ray import serve

from engine import SamplingParams

from .decode_rank import _join_expert_parallel
from .engine_host import load_engine, make_transport, report_stats
from .metrics import EngineMetrics


class PrefillWorker:
    """One prefill engine with its KV transport (in a replica, or in a PrefillRank actor)."""

    def __init__(self, model_path: str, engine_cfg: dict, device: str, transfer_timeout_s: float,
                 tag: str, ep=None):
        self.engine = load_engine(model_path, engine_cfg, device, ep)
        self.transport = make_transport(self.engine, "prefill")
        self.timeout = transfer_timeout_s
        self.metrics = EngineMetrics("prefill", tag)
        self._reporter = None
        self.served = 0

    async def prefill(self, payload: dict) -> dict:
        """Computes the prompt's KV and its first token, then writes the blocks the decode rank
        has not cached into `dst_blocks` (NIXL WRITE + notification). Returns the first token."""
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(report_stats(self.engine, self.metrics))
        rid = f"{payload['request_id']}:prefill"
        params = SamplingParams(max_tokens=1, ignore_eos=True, **payload["sampling"])
        last = None
        async for last in self.engine.generate(rid, payload["prompt_token_ids"], params, hold_kv=True):
            pass
        if last is None or last.finish_reason in ("abort", "error"):
            raise RuntimeError(f"prefill of {payload['request_id']} failed: {last and last.error}")
        try:
            src = self.engine.held_blocks(rid)[payload["cached_blocks"]:]
            peer = self.transport.connect(payload["kv_peer"])
            handle = self.transport.write_blocks(peer, src, payload["dst_blocks"], payload["notif"])
            await self.transport.wait_async(handle, self.timeout)
        finally:
            self.engine.release_held(rid)
        nbytes = len(src) * self._bytes_per_block()
        self.metrics.kv_bytes.inc(nbytes, self.metrics.tags)
        self.served += 1
        return {"first_token": last.output_token_ids[0], "bytes": nbytes,
                "prefix_hit_tokens": last.num_cached_tokens}

    def _bytes_per_block(self) -> int:
        kv = self.engine.engine.runner.kv
        bs = self.engine.engine.cfg.block_size
        return sum(t.shape[0] * bs * t.shape[2] * t.element_size()
                   for t in (kv.global_kv, kv.index_keys) if t is not None)

    def stats(self) -> dict:
        return dict(self.engine.stats(), served=self.served)


@ray.remote
class PrefillRank:
    """One rank of a prefill group of more than one GPU."""

    def __init__(self, rank: int, model_path: str, engine_cfg: dict, device: str, transfer_timeout_s: float,
                 tag: str):
        self.args = (model_path, engine_cfg, device, transfer_timeout_s, f"{tag}/{rank}")
        self.rank = rank
        self.worker = None

    def endpoint(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, ep: dict) -> None:
        model_path = self.args[0]
        self.worker = PrefillWorker(*self.args, ep=_join_expert_parallel(self.rank, ep, model_path))

    async def prefill(self, payload: dict) -> dict:
        return await self.worker.prefill(payload)

    def stats(self) -> dict:
        return dict(self.worker.stats(), rank=self.rank)


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, model_path: str, engine_cfg: dict, device: str = "cpu", transfer_timeout_s: float = 30.0,
                 group_size: int = 1, num_slots: int | None = None):
        tag = serve.get_replica_context().replica_tag
        self.worker, self.ranks = None, []
        if group_size == 1:
            self.worker = PrefillWorker(model_path, engine_cfg, device, transfer_timeout_s, tag)
            return
        options = self._rank_options(group_size, device)
        self.ranks = [PrefillRank.options(**options[r]).remote(r, model_path, engine_cfg, device,
                                                               transfer_timeout_s, tag)
                      for r in range(group_size)]
        addr, port = ray.get(self.ranks[0].endpoint.remote())
        ep = {"addr": addr, "port": port, "world": group_size, "backend": "nccl" if device == "cuda" else "gloo",
              "num_slots": num_slots}
        ray.get([rank.start.remote(ep) for rank in self.ranks])
        self.inflight = [0] * group_size
        self.dispatched = [0] * group_size

    @staticmethod
    def _rank_options(group_size: int, device: str) -> list[dict]:
        if device != "cuda":
            return [{"num_cpus": 0}] * group_size
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # a prefill group is a small pack: all its GPUs on one node, so its EP traffic stays on NVLink
        pg = placement_group([{"GPU": 1}] * group_size, strategy="STRICT_PACK", name=f"prefill-{uuid.uuid4().hex[:6]}")
        ray.get(pg.ready())
        return [{"num_gpus": 1, "num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=r)} for r in range(group_size)]

    async def prefill(self, payload: dict, session_id: str | None = None) -> dict:
        """See PrefillWorker.prefill; session_id is read by the session-affinity router."""
        if self.worker is not None:
            return await self.worker.prefill(payload)
        rank = min(range(len(self.ranks)), key=lambda r: (self.inflight[r], self.dispatched[r]))
        self.inflight[rank] += 1
        self.dispatched[rank] += 1
        try:
            return await self.ranks[rank].prefill.remote(payload)
        finally:
            self.inflight[rank] -= 1

    async def stats(self) -> dict:
        if self.worker is not None:
            return self.worker.stats()
        per_rank = await asyncio.gather(*[rank.stats.remote() for rank in self.ranks])
        total = {k: sum(s[k] for s in per_rank) for k in ("served", "held_kv", "kv_blocks_used", "running")}
        return dict(total, ranks=per_rank)
