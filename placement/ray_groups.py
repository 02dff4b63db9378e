"""Turn a Plan into Ray placement groups, wait for them, and check the result.

The only module of placement/ that imports Ray (lazily, inside functions, so
importing it costs nothing where Ray is absent).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from placement.plan import GroupPlan, Layout, Plan, make_plan, pg_request
from placement.topology import DOMAIN_LABEL, cluster_from_ray_nodes


class PlacementTimeout(RuntimeError):
    """Placement groups that did not become ready in time; the message says which and why."""


@dataclass
class PlacedGroup:
    plan: GroupPlan
    pg: Any  # ray.util.placement_group.PlacementGroup
    request: dict[str, Any]


def live_plan(layout: Layout, domain_label: str = DOMAIN_LABEL) -> Plan:
    """Plan ``layout`` on the Ray cluster this process is connected to."""
    import ray

    return make_plan(cluster_from_ray_nodes(ray.nodes(), domain_label), layout)


def create_groups(
    plan: Plan, domain_label: str = DOMAIN_LABEL, pin_nodes: bool = True, lifetime: str | None = None
) -> dict[str, PlacedGroup]:
    """Submit one placement group per planned group (returns at once)."""
    from ray.util.placement_group import placement_group

    out: dict[str, PlacedGroup] = {}
    for g in plan.groups:
        req = pg_request(plan, g, domain_label, pin_nodes)
        pg = placement_group(lifetime=lifetime, **req)
        out[g.spec.name] = PlacedGroup(g, pg, req)
    return out


def _why(placed: PlacedGroup) -> str:
    from ray.util.placement_group import placement_group_table

    spec = placed.plan.spec
    req = placed.request
    sel = req.get("bundle_label_selector") or []
    wanted = sorted({f"{k}={v}" for s in sel for k, v in s.items()})
    try:
        table = placement_group_table(placed.pg)
        state = table.get("state")
        sched = (table.get("stats") or {}).get("scheduling_state")
    except Exception:  # the table is diagnostics only
        state, sched = "?", "?"
    where = f" on nodes labelled {', '.join(wanted)}" if wanted else ""
    return (
        f"{spec.role} group {spec.name!r}: {len(req['bundles'])} x {req['bundles'][0]} "
        f"{req['strategy']}{where} (state {state}, scheduling {sched})"
    )


def wait_ready(placed: dict[str, PlacedGroup], timeout_s: float) -> None:
    """Block until every group is ready, or raise PlacementTimeout naming the stuck ones."""
    import ray

    refs = {p.pg.ready(): name for name, p in placed.items()}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    ray.get(ready)
    if pending:
        stuck = [placed[refs[r]] for r in pending]
        lines = "\n  ".join(_why(p) for p in stuck)
        raise PlacementTimeout(
            f"{len(stuck)} of {len(placed)} placement group(s) not ready after {timeout_s:.0f}s:\n  {lines}\n"
            "Check that the cluster has free GPUs on nodes carrying those labels "
            "(`ray status`, `ray list nodes --detail`; dry run: `python -m placement --cluster ray`)."
        )


def remove_groups(placed: dict[str, PlacedGroup]) -> None:
    from ray.util.placement_group import remove_placement_group

    for p in placed.values():
        remove_placement_group(p.pg)


def rank_options(placed: PlacedGroup, rank: int, rank_cpus: float = 0.0) -> dict[str, Any]:
    """``.options(...)`` for the actor of ``rank``: its bundle, its GPU, no spare CPU."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not 0 <= rank < len(placed.plan.slots):
        raise IndexError(f"group {placed.plan.spec.name!r} has ranks 0..{len(placed.plan.slots) - 1}, not {rank}")
    cuda = placed.plan.spec.device == "cuda"
    return {
        "num_cpus": rank_cpus if cuda else max(rank_cpus, 1.0),
        "num_gpus": 1 if cuda else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=placed.pg,
            placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True,
        ),
    }


def where_am_i() -> dict[str, Any]:
    """Called inside a rank actor: the node, labels and GPU Ray gave it."""
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "labels": dict(ctx.get_node_labels()),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def check_ranks(
    plan: Plan,
    group: GroupPlan,
    reports: list[dict[str, Any]],
    domain_label: str = DOMAIN_LABEL,
    strict_gpu: bool = False,
) -> list[str]:
    """Compare where ranks landed with the plan. Returns problems, empty when all agree.

    Checked: the domain label of each rank's node, the node itself when the
    plan knows Ray node ids, exactly one GPU per rank matching
    CUDA_VISIBLE_DEVICES, and no GPU shared by two ranks of the group. With
    ``strict_gpu`` also the planned GPU index: Ray hands out a node's GPU ids
    in bundle order, so on nodes the application has to itself the dry run's
    GPU column is what ranks get; with other GPU users about, it may differ
    while every other property still holds.
    """
    problems: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for slot, rep in zip(group.slots, reports):
        tag = f"{group.spec.name} rank {slot.rank}"
        if slot.domain is not None and rep["labels"].get(domain_label) != slot.domain:
            problems.append(f"{tag}: on domain {rep['labels'].get(domain_label)!r}, planned {slot.domain!r}")
        node = plan.cluster.node(slot.node) if slot.node else None
        if node is not None and node.ray_node_id and rep["node_id"] != node.ray_node_id:
            problems.append(f"{tag}: on node {rep['node_id'][:8]}, planned {slot.node}")
        if group.spec.device == "cuda":
            if len(rep["gpu_ids"]) != 1:
                problems.append(f"{tag}: sees GPUs {rep['gpu_ids']}, expected exactly one")
                continue
            if rep["cuda_visible_devices"] != rep["gpu_ids"][0]:
                problems.append(
                    f"{tag}: CUDA_VISIBLE_DEVICES={rep['cuda_visible_devices']!r} but Ray assigned GPU {rep['gpu_ids'][0]}"
                )
            if strict_gpu and slot.gpu is not None and rep["gpu_ids"][0] != str(slot.gpu):
                problems.append(f"{tag}: got GPU {rep['gpu_ids'][0]}, planned GPU {slot.gpu}")
            key = (rep["node_id"], rep["gpu_ids"][0])
            if key in seen:
                problems.append(f"{tag}: shares GPU {key[1]} of node {key[0][:8]} with rank {seen[key]}")
            seen[key] = slot.rank
    if len(reports) != len(group.slots):
        problems.append(f"{group.spec.name}: {len(reports)} reports for {len(group.slots)} ranks")
    return problems


def group_rank_options(layout: Layout, group_name: str, domain_label: str = DOMAIN_LABEL, pin_nodes: bool = True,
                       rank_cpus: float = 0.0, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Plan the whole layout on the live cluster (so a layout that cannot fit fails here, with
    what is missing), reserve only `group_name`'s placement group, and return the
    ``.options(...)`` of each of its ranks. Call it from the process that owns the ranks: the
    group lives as long as that process."""
    import dataclasses

    plan = live_plan(layout, domain_label)
    only = dataclasses.replace(plan, groups=[plan.group(group_name)])
    placed = create_groups(only, domain_label=domain_label, pin_nodes=pin_nodes)
    wait_ready(placed, timeout_s)
    group = placed[group_name]
    return [rank_options(group, r, rank_cpus) for r in range(len(group.plan.slots))]
