"""What every engine-hosting actor shares: load the engine, keep its metrics fresh, expose
its KV pool to the transport."""
from __future__ import annotations

import asyncio
import os
import uuid

import torch

from engine import AsyncLLMEngine, EngineConfig, LLMEngine

from .metrics import EngineMetrics


def load_engine(model_path: str, engine_cfg: dict, device: str, ep=None) -> AsyncLLMEngine:
    if device == "cpu":
        # Several engines share a few cores; one thread each avoids oversubscription.
        torch.set_num_threads(int(os.environ.get("WIDEEP_CPU_THREADS", "1")))
    cfg = EngineConfig(**dict(engine_cfg, device="cuda" if device == "cuda" else "cpu"))
    return AsyncLLMEngine(LLMEngine.from_pretrained(model_path, cfg, progress=False, ep=ep))


def make_transport(engine: AsyncLLMEngine, role: str):
    """A KV transport over the engine's global KV (its FP8 scales, indexer keys): the only state
    that moves."""
    from engine.kv_transfer import KVTransport, transfer_tensors

    tensors = transfer_tensors(engine.engine.runner.kv)
    return KVTransport(f"{role}-{uuid.uuid4().hex[:8]}", tensors, engine.engine.cfg.block_size)


async def report_stats(engine: AsyncLLMEngine, metrics: EngineMetrics, period_s: float = 1.0) -> None:
    while True:
        metrics.observe_stats(engine.stats())
        await asyncio.sleep(period_s)
