"""One DP rank of a decode group: an engine in a Ray actor.

A request's prompt is prefilled here when its uncached part is small (the usual next turn
of an agent session); otherwise a prefill server runs it and writes the prompt's KV into
blocks this rank reserved. A failed or late transfer falls back to local prefill.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

from engine import SamplingParams

from .engine_host import load_engine, make_transport, report_stats
from .metrics import EngineMetrics

log = logging.getLogger(__name__)


@ray.remote
class DecodeRank:
    def __init__(self, rank: int, model_path: str, engine_cfg: dict, device: str,
                 prefill_handle=None, local_prefill_max_tokens: int = 256, transfer_timeout_s: float = 30.0):
        self.rank = rank
        self.engine = load_engine(model_path, engine_cfg, device)
        self.prefill = prefill_handle
        self.transport = make_transport(self.engine, f"decode{rank}") if prefill_handle is not None else None
        self.local_max = local_prefill_max_tokens
        self.timeout = transfer_timeout_s
        self.metrics = EngineMetrics("decode", rank)
        self.paths = {"remote": 0, "local": 0, "fallback": 0}
        self.kv_bytes = 0
        self.prefill_side_hits = 0  # prompt tokens the prefill server found in its own cache
        self._reporter = None

    def ready(self) -> dict:
        return {"rank": self.rank, "max_model_len": self.engine.engine.max_model_len}

    def stats(self) -> dict:
        return dict(self.engine.stats(), rank=self.rank, kv_bytes_received=self.kv_bytes,
                    prefill_side_hit_tokens=self.prefill_side_hits, **{
            f"prefill_{k}": v for k, v in self.paths.items()})

    async def generate(self, request: dict, session_id: str | None = None):
        """Streams one dict per token (see engine_host.output_dict)."""
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(report_stats(self.engine, self.metrics))
        rid = request["request_id"]
        params = SamplingParams(**request.get("sampling", {}))
        prompt = request.get("prompt_token_ids") or request.get("prompt")
        remote = self._remote_prefill(rid, params, session_id) if self.transport is not None else None
        start, last = time.monotonic(), None
        async for out in self.engine.generate(rid, prompt, params, messages=request.get("messages"),
                                              remote_prefill=remote):
            now = time.monotonic()
            if out.new_token_ids:
                if last is None:
                    self.metrics.ttft.observe(now - start, self.metrics.tags)
                else:
                    self.metrics.itl.observe(now - last, self.metrics.tags)
                last = now
            yield out.stream_dict()

    def _remote_prefill(self, rid: str, params: SamplingParams, session_id: str | None):
        async def run(reservation: dict) -> int | None:
            uncached = len(reservation["prompt_token_ids"]) - reservation["cached_blocks"] * reservation["block_size"]
            if uncached <= self.local_max:
                self._count("local")
                return None
            notif = f"kv:{rid}".encode()
            payload = dict(reservation, request_id=rid, notif=notif, kv_peer=self.transport.metadata(),
                           sampling={"temperature": params.temperature, "top_p": params.top_p,
                                     "top_k": params.top_k, "seed": params.seed})
            # Wait for the notification while the prefill runs: with UCX over TCP the target must
            # make progress (the transport's polling) for the write to complete at all.
            waiter = asyncio.ensure_future(self.transport.wait_notification_async(notif, self.timeout))
            try:
                reply = await asyncio.wait_for(self.prefill.prefill.remote(payload, session_id=session_id),
                                               self.timeout)
                if not await waiter:
                    raise TimeoutError("KV written but no notification arrived")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of the remote path: recompute here
                log.warning("remote prefill of %s failed (%s); prefilling locally", rid, e)
                self.transport.discard_notification(notif)  # a late write must not be mistaken later
                self._count("fallback")
                return None
            finally:
                waiter.cancel()
            self._count("remote")
            self.kv_bytes += reply["bytes"]
            self.prefill_side_hits += reply["prefix_hit_tokens"]
            self.metrics.kv_bytes.inc(reply["bytes"], self.metrics.tags)
            return reply["first_token"]
        return run

    def _count(self, path: str) -> None:
        self.paths[path] += 1
        self.metrics.prefill_path(path)
