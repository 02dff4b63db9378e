"""Prefill server: runs prompts and pushes their global KV into blocks a decode rank reserved.

An autoscaled Serve deployment; requests carry a session id so the session router keeps a
session's turns on the replica that already holds its prefix.
"""
from __future__ import annotations

import asyncio

from ray import serve

from engine import SamplingParams

from .engine_host import load_engine, make_transport, report_stats
from .metrics import EngineMetrics


@serve.deployment(name="PrefillServer")
class PrefillServer:
    def __init__(self, model_path: str, engine_cfg: dict, device: str = "cpu", transfer_timeout_s: float = 30.0):
        self.engine = load_engine(model_path, engine_cfg, device)
        self.transport = make_transport(self.engine, "prefill")
        self.timeout = transfer_timeout_s
        self.metrics = EngineMetrics("prefill", serve.get_replica_context().replica_tag)
        self._reporter = None
        self.served = 0

    async def prefill(self, payload: dict, session_id: str | None = None) -> dict:
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
