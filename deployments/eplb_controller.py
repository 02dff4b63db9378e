"""The EPLB controller: a Ray actor beside a decode group that watches expert load and
re-places experts without pausing decode (see engine/ep.py for the rank side).

Every `interval_s` (or on demand) it pulls each rank's per-slot token counts, plans a new
placement with the hierarchical policy, and when the predicted balance gain is worth it:
every rank stages its incoming experts while decoding on; once all have staged, all are told
to commit and switch together at the next step they agree on. A rank that fails or times
out abandons the plan everywhere; the old placement stays. Statistics and plans are per
model ("main"; a draft model gets its own controller state under its own name).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import ray
import torch
from ray.util import metrics

from engine.eplb_policy import Placement, imbalance, moved_experts, predicted_gain, rebalance

log = logging.getLogger(__name__)


@ray.remote
class EPLBController:
    def __init__(self, ranks: list, phys2log: list, num_logical: int, num_groups: int = 1, model: str = "main",
                 interval_s: float = 30.0, min_gain: float = 0.05, stage_timeout_s: float = 30.0,
                 bytes_per_expert: int = 0):
        self.ranks = ranks
        self.model = model
        self.placement = Placement(torch.tensor(phys2log).long(), num_logical, len(ranks))
        self.num_groups = num_groups
        self.interval_s, self.min_gain, self.timeout = interval_s, min_gain, stage_timeout_s
        self.bytes_per_expert = bytes_per_expert
        self.window = torch.zeros(self.placement.phys2log.shape, dtype=torch.long)
        self.busy = False
        self.history: list[dict] = []
        self.abandoned = 0
        tags = ("model",)
        self.m_imbalance = metrics.Gauge("wideep_eplb_imbalance", "max/mean rank load of a MoE layer",
                                         ("model", "layer"))
        self.m_plan = metrics.Histogram("wideep_eplb_plan_s", "EPLB plan time (s)",
                                        [0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 5], tags)
        self.m_migration = metrics.Histogram("wideep_eplb_migration_s", "Expert migration wall time (s)",
                                             [0.01, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30], tags)
        self.m_bytes = metrics.Counter("wideep_eplb_bytes_moved", "Expert weight bytes moved", tags)
        self.m_abandoned = metrics.Counter("wideep_eplb_migrations_abandoned", "Migrations abandoned", tags)
        self._loop = None

    async def start(self) -> None:
        if self._loop is None and self.interval_s > 0:
            self._loop = asyncio.get_running_loop().create_task(self._periodic())

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.rebalance()
            except Exception:  # a bad round must not stop balancing
                log.exception("EPLB round failed")

    async def rebalance(self, force: bool = False, stage_delay_s: float = 0.0) -> dict:
        """One round: pull loads, plan, and migrate when worth it (always, with force)."""
        if self.busy:
            return {"action": "skipped", "reason": "a migration is in progress"}
        self.busy = True
        try:
            return await self._round(force, stage_delay_s)
        finally:
            self.busy = False

    async def migrate_to(self, phys2log: list, stage_delay_s: float = 0.0) -> dict:
        """Move to a given placement (pinning experts by hand); validated like any plan."""
        from engine.eplb_policy import validate

        proposed = Placement(torch.tensor(phys2log).long(), self.placement.num_logical, self.placement.num_ranks)
        validate(proposed, proposed.num_logical, proposed.num_ranks)
        if proposed.phys2log.shape != self.placement.phys2log.shape:
            raise ValueError(f"placement shape {tuple(proposed.phys2log.shape)}, "
                             f"expected {tuple(self.placement.phys2log.shape)}")
        if self.busy:
            return {"action": "skipped", "reason": "a migration is in progress"}
        self.busy = True
        try:
            report = await self._migrate(proposed, stage_delay_s)
            if report["action"] == "switched":
                self.placement = proposed
                self.window.zero_()
            return self._record(report)
        finally:
            self.busy = False

    async def _round(self, force: bool, stage_delay_s: float) -> dict:
        loads = await asyncio.gather(*[r.ep_take_load.remote() for r in self.ranks])
        self.window += torch.cat([torch.tensor(x, dtype=torch.long) for x in loads], dim=1)
        current = self.placement
        logical = torch.zeros(current.num_layers, current.num_logical, dtype=torch.long).scatter_add_(
            1, current.phys2log, self.window)
        t0 = time.perf_counter()
        proposed = rebalance(logical, num_slots=current.num_slots, num_ranks=current.num_ranks,
                             num_groups=self.num_groups, current=current)
        plan_s = time.perf_counter() - t0
        self.m_plan.observe(plan_s, {"model": self.model})
        before, after = imbalance(logical, current), imbalance(logical, proposed)
        for layer, value in enumerate(before.tolist()):
            self.m_imbalance.set(value, {"model": self.model, "layer": str(layer)})
        report = {"model": self.model, "plan_s": plan_s, "tokens": int(self.window.sum()),
                  "imbalance_before": before.tolist(), "imbalance_after": after.tolist(),
                  "gain": predicted_gain(logical, current, proposed)}
        moved = moved_experts(current, proposed)
        if not moved or (not force and report["gain"] < self.min_gain):
            report["action"] = "kept"
            return self._record(report)
        report.update(await self._migrate(proposed, stage_delay_s), moved_slots=len(moved))
        if report["action"] == "switched":
            self.placement = proposed
            self.window.zero_()
            for layer, value in enumerate(after.tolist()):
                self.m_imbalance.set(value, {"model": self.model, "layer": str(layer)})
        return self._record(report)

    async def _migrate(self, proposed: Placement, stage_delay_s: float) -> dict:
        plan_id = uuid.uuid4().hex[:8]
        t0 = time.perf_counter()
        statuses = await asyncio.gather(*[r.ep_status.remote() for r in self.ranks])
        try:
            plan = proposed.phys2log.tolist()
            await asyncio.gather(*[r.ep_stage.remote(plan_id, plan, stage_delay_s) for r in self.ranks])
            staged = await asyncio.wait_for(asyncio.gather(
                *[r.ep_wait_staged.remote(plan_id, self.timeout) for r in self.ranks]), self.timeout + 5)
            failed = [s.get("error") for s in staged if not s["staged"]]
            if failed:
                raise RuntimeError(f"staging failed: {failed[0]}")
            staged_s = time.perf_counter() - t0
            await asyncio.gather(*[r.ep_commit.remote(plan_id) for r in self.ranks])
            await self._until_switched([s["switches"] for s in statuses])
        except Exception as e:  # includes a dead rank (RayActorError) and timeouts
            await self._abort(plan_id)
            self.abandoned += 1
            self.m_abandoned.inc(1, {"model": self.model})
            return {"action": "abandoned", "plan_id": plan_id, "error": f"{type(e).__name__}: {e}"}
        seconds = time.perf_counter() - t0
        moved_bytes = sum(s["bytes"] for s in staged)
        self.m_migration.observe(seconds, {"model": self.model})
        self.m_bytes.inc(moved_bytes, {"model": self.model})
        return {"action": "switched", "plan_id": plan_id, "migration_s": seconds, "staging_s": staged_s,
                "bytes_moved": moved_bytes}

    async def _until_switched(self, before: list[int]) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            now = await asyncio.gather(*[r.ep_status.remote() for r in self.ranks])
            if all(s["switches"] > b for s, b in zip(now, before)):
                return
            await asyncio.sleep(0.005)
        raise TimeoutError(f"ranks did not switch within {self.timeout} s")

    async def _abort(self, plan_id: str) -> None:
        # Best effort: a dead rank cannot answer, the live ones must drop the plan.
        await asyncio.gather(*[r.ep_abort.remote(plan_id) for r in self.ranks], return_exceptions=True)

    def _record(self, report: dict) -> dict:
        self.history.append(report)
        del self.history[:-50]
        return report

    def status(self) -> dict:
        return {"model": self.model, "phys2log": self.placement.phys2log.tolist(), "abandoned": self.abandoned,
                "rounds": len(self.history), "last": self.history[-1] if self.history else None}
