"""Prefill server: runs prompts and pushes their global KV into blocks a decode rank reserved.

An autoscaled Serve deployment; requests carry a session id so the session router keeps a
session's turns on the replica that already holds its prefix. A replica is one prefill
group: with `group_size` 1 its engine lives in the replica; with more, the replica owns
`group_size` rank actors (DP attention + EP MoE in lockstep, packed on one node) and hands
each prompt to the rank with the fewest in flight.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

import ray
from ray import serve

from engine import SamplingParams
from engine.kv_ipc import IpcTransferError, IpcTransport, pool_tensors

from .decode_rank import _join_expert_parallel
from .engine_host import load_engine, make_transport, report_stats
from .metrics import EngineMetrics

log = logging.getLogger(__name__)


class PrefillWorker:
    """One prefill engine with its KV transports (in a replica, or in a PrefillRank actor).

    kv_transport "nixl": NIXL only; "ipc": writes into the decode rank's mapped pool only (same
    host); "auto": IPC where the decode rank offers it and is on this host, else NIXL."""

    def __init__(self, model_path: str, engine_cfg: dict, device: str, transfer_timeout_s: float,
                 tag: str, ep=None, kv_transport: str = "nixl"):
        if kv_transport not in ("nixl", "ipc", "auto"):
            raise ValueError(f"kv_transport must be 'nixl', 'ipc' or 'auto', got {kv_transport!r}")
        self.engine = load_engine(model_path, engine_cfg, device, ep)
        self.kv_transport = kv_transport
        self.transport = make_transport(self.engine, "prefill") if kv_transport != "ipc" else None
        e = self.engine.engine
        self.ipc = (IpcTransport(f"prefill-{uuid.uuid4().hex[:8]}", pool_tensors(e.runner.kv), e.cfg.block_size)
                    if kv_transport != "nixl" else None)
        self._ipc_refused: dict[tuple[str, str], str] = {}  # (peer, export id) -> why IPC cannot reach it
        self.transfers = {"ipc": 0, "nixl": 0}
        self.timeout = transfer_timeout_s
        self.metrics = EngineMetrics("prefill", tag)
        self._reporter = None
        self.served = 0

    async def prefill(self, payload: dict) -> dict:
        """Computes the prompt's KV and its first token, then writes the blocks the decode rank
        has not cached into `dst_blocks` (an IPC write, or a NIXL WRITE + notification). Returns
        the first token and which transport moved the KV; over IPC the bytes have landed by then."""
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
            via, nbytes = await self._write(payload, src)
        finally:
            self.engine.release_held(rid)
        self.metrics.kv_bytes.inc(nbytes, self.metrics.tags)
        self.served += 1
        self.transfers[via] += 1
        return {"first_token": last.output_token_ids[0], "first_logprobs": (last.logprobs or [None])[0],
                "bytes": nbytes, "prefix_hit_tokens": last.num_cached_tokens, "transport": via}

    async def _write(self, payload: dict, src: list[int]) -> tuple[str, int]:
        peer = self._ipc_peer(payload)
        if peer is not None:
            handle = self.ipc.write_blocks(peer, src, payload["dst_blocks"])
            await self.ipc.wait_async(handle, self.timeout)
            return "ipc", handle.nbytes
        if self.transport is None or "kv_peer" not in payload:
            offered = sorted(k for k in payload if k.startswith("kv_"))
            raise RuntimeError(f"no KV transport in common with the decode rank: this server's kv_transport is "
                               f"{self.kv_transport!r}, the request offers {offered}")
        peer = self.transport.connect(payload["kv_peer"])
        handle = self.transport.write_blocks(peer, src, payload["dst_blocks"], payload["notif"])
        await self.transport.wait_async(handle, self.timeout)
        return "nixl", len(src) * self._bytes_per_block()

    def _ipc_peer(self, payload: dict) -> str | None:
        """The decode rank as an opened IPC peer, or None where NIXL is to be used instead (auto:
        no IPC handle offered, another host, or a pool that cannot be mapped here)."""
        meta = payload.get("kv_ipc")
        if self.ipc is None or meta is None:
            return None
        key = (meta.get("name", "?"), meta.get("export_id", "?"))
        why = self._ipc_refused.get(key)
        if why is None:
            try:
                return self.ipc.connect(meta)
            except IpcTransferError as e:
                why = self._ipc_refused[key] = str(e)
                if self.transport is not None and "kv_peer" in payload:
                    log.warning("IPC to %s unavailable (%s); using NIXL for it", key[0], why)
        if self.transport is None or "kv_peer" not in payload:
            raise IpcTransferError(why)
        return None

    def _bytes_per_block(self) -> int:
        kv = self.engine.engine.runner.kv
        bs = self.engine.engine.cfg.block_size
        return sum(t.shape[0] * bs * t.shape[2] * t.element_size()
                   for t in (kv.global_kv, kv.index_keys) if t is not None)

    def stats(self) -> dict:
        return dict(self.engine.stats(), served=self.served, kv_transport=self.kv_transport,
                    **{f"kv_transfers_{k}": v for k, v in self.transfers.items()})


@ray.remote
class PrefillRank:
    """One rank of a prefill group of more than one GPU."""

    def __init__(self, rank: int, model_path: str, engine_cfg: dict, device: str, transfer_timeout_s: float,
                 tag: str, kv_transport: str = "nixl"):
        self.args = (model_path, engine_cfg, device, transfer_timeout_s, f"{tag}/{rank}")
        self.kv_transport = kv_transport
        self.rank = rank
        self.worker = None

    def endpoint(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, ep: dict) -> None:
        model_path = self.args[0]
        self.worker = PrefillWorker(*self.args, ep=_join_expert_parallel(self.rank, ep, model_path),
                                    kv_transport=self.kv_transport)

    async def prefill(self, payload: dict) -> dict:
        return await self.worker.prefill(payload)

    def stats(self) -> dict:
        return dict(self.worker.stats(), rank=self.rank)


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, model_path: str, engine_cfg: dict, device: str = "cpu", transfer_timeout_s: float = 30.0,
                 group_size: int = 1, num_slots: int | None = None, kv_transport: str = "nixl"):
        tag = serve.get_replica_context().replica_tag
        self.worker, self.ranks = None, []
        if group_size == 1:
            self.worker = PrefillWorker(model_path, engine_cfg, device, transfer_timeout_s, tag,
                                        kv_transport=kv_transport)
            return
        options = self._rank_options(group_size, device)
        self.ranks = [PrefillRank.options(**options[r]).remote(r, model_path, engine_cfg, device,
                                                               transfer_timeout_s, tag, kv_transport)
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
        total = {k: sum(s[k] for s in per_rank) for k in ("served", "held_kv", "kv_blocks_used", "running",
                                                         "kv_transfers_ipc", "kv_transfers_nixl")}
        return dict(total, ranks=per_rank)
