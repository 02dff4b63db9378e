"""Placement plans: which rank of which group goes to which node, GPU and domain.

Pure Python: a plan is computed from a ``Cluster`` and a ``Layout`` and can be
printed (dry run), checked in tests, or turned into Ray placement-group
requests (``pg_request``) that ``placement.ray_groups`` submits.

Rules:
- a decode group (Wide-EP: DP attention + EP MoE) lives inside one NVLink
  domain, because every MoE layer does an all-to-all across all its ranks;
- prefill groups are small (DEP2 ...) and go on one node if they fit there,
  anywhere in the cluster;
- ranks are laid out node-major, so rank r and r+1 share a node whenever they
  can: EP neighbours stay on the fastest links and a node's NIC serves
  consecutive ranks;
- the EPLB controller and the ingress take CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from placement.topology import DOMAIN_LABEL, RAY_NODE_ID_LABEL, ROLE_LABEL, Cluster, Domain, Node, label_value


class PlacementError(ValueError):
    """The layout cannot be placed on the cluster; the message says why."""


@dataclass(frozen=True)
class GroupSpec:
    """A set of ranks that must be placed together.

    ``span`` is "domain" (all ranks inside one NVLink domain) or "node" (all
    ranks on one node when possible, else inside one domain).
    """

    name: str
    role: str  # "decode" | "prefill"
    size: int
    device: str = "cuda"  # "cuda" | "cpu"
    span: str = "domain"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise PlacementError(f"group {self.name!r}: size must be >= 1, got {self.size}")
        if self.span not in ("domain", "node"):
            raise PlacementError(f"group {self.name!r}: span must be 'domain' or 'node', got {self.span!r}")
        if self.device not in ("cuda", "cpu"):
            raise PlacementError(f"group {self.name!r}: device must be 'cuda' or 'cpu', got {self.device!r}")


@dataclass(frozen=True)
class CpuActorSpec:
    name: str
    num_cpus: float = 1.0


@dataclass
class Layout:
    """Everything one application asks the cluster for."""

    groups: list[GroupSpec]
    cpu_actors: list[CpuActorSpec] = field(default_factory=list)
    rank_cpus: float = 0.0  # CPUs reserved per rank bundle besides its GPU


@dataclass(frozen=True)
class RankSlot:
    group: str
    rank: int
    node: str | None  # None: any node (CPU ranks)
    gpu: int | None  # local GPU index on the node; None for CPU ranks
    domain: str | None


@dataclass
class GroupPlan:
    spec: GroupSpec
    slots: list[RankSlot]

    @property
    def domain(self) -> str | None:
        doms = {s.domain for s in self.slots}
        return doms.pop() if len(doms) == 1 else None

    @property
    def nodes(self) -> list[str]:
        out: list[str] = []
        for s in self.slots:
            if s.node is not None and s.node not in out:
                out.append(s.node)
        return out


@dataclass
class CpuActorPlan:
    spec: CpuActorSpec
    node: str | None
    ray_options: dict[str, Any]


@dataclass
class Plan:
    cluster: Cluster
    groups: list[GroupPlan]
    cpu_actors: list[CpuActorPlan]
    rank_cpus: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.spec.name == name:
                return g
        raise KeyError(name)

    @property
    def gpus_used(self) -> int:
        return sum(1 for g in self.groups for s in g.slots if s.gpu is not None)


# ---------------------------------------------------------------------------


def _domain_table(cluster: Cluster, free: dict[str, list[int]]) -> str:
    rows = []
    for d in sorted(cluster.domains, key=lambda d: (-d.num_gpus, d.id)):
        left = sum(len(free[n.name]) for n in d.nodes)
        rows.append(f"{d.id}: {left} free of {d.num_gpus} GPU(s) on {len(d.nodes)} node(s)")
    return "; ".join(rows) if rows else "no GPU nodes"


def _take(nodes: list[Node], free: dict[str, list[int]], size: int) -> list[tuple[Node, int]]:
    """Take ``size`` GPUs from ``nodes``, fullest-free nodes first, node-major."""
    order = sorted(nodes, key=lambda n: (-len(free[n.name]), n.name))
    picked: list[tuple[Node, int]] = []
    for node in order:
        while free[node.name] and len(picked) < size:
            picked.append((node, free[node.name].pop(0)))
        if len(picked) == size:
            break
    return picked


def _place_in_domain(spec: GroupSpec, cluster: Cluster, free: dict[str, list[int]]) -> list[RankSlot]:
    domains = cluster.domains
    if not domains:
        raise PlacementError(
            f"{spec.role} group {spec.name!r} needs {spec.size} GPU(s) but the cluster has no GPU nodes"
        )
    largest = max(d.num_gpus for d in domains)
    if spec.size > largest:
        biggest = [d.id for d in domains if d.num_gpus == largest]
        raise PlacementError(
            f"{spec.role} group {spec.name!r} (DEP{spec.size}) needs {spec.size} GPUs in one NVLink domain, "
            f"but the largest NVLink domain in cluster {cluster.name or '?'!r} has {largest} GPUs "
            f"({', '.join(biggest)}). Lower the group's size to at most {largest}, or run on a cluster with a "
            f"larger NVLink domain (an NVL72 rack has 72 GPUs in one domain)."
        )

    def free_in(d: Domain) -> int:
        return sum(len(free[n.name]) for n in d.nodes)

    fitting = [d for d in domains if free_in(d) >= spec.size]
    if not fitting:
        raise PlacementError(
            f"{spec.role} group {spec.name!r} (DEP{spec.size}) needs {spec.size} free GPUs in one NVLink domain; "
            f"groups placed before it left none large enough. Domains: {_domain_table(cluster, free)}"
        )
    # Best fit: the domain with the least room that still fits keeps big
    # domains whole for later big groups.
    best = min(fitting, key=lambda d: (free_in(d), d.id))
    picked = _take(best.nodes, free, spec.size)
    return [RankSlot(spec.name, r, n.name, g, n.domain) for r, (n, g) in enumerate(picked)]


def _place_on_node(spec: GroupSpec, cluster: Cluster, free: dict[str, list[int]]) -> list[RankSlot]:
    gpu_nodes = [n for n in cluster.nodes if n.is_gpu]
    fitting = [n for n in gpu_nodes if len(free[n.name]) >= spec.size]
    if fitting:
        node = min(fitting, key=lambda n: (len(free[n.name]), n.name))
        picked = [(node, free[node.name].pop(0)) for _ in range(spec.size)]
        return [RankSlot(spec.name, r, n.name, g, n.domain) for r, (n, g) in enumerate(picked)]
    max_node = max((n.num_gpus for n in gpu_nodes), default=0)
    if spec.size > max_node:
        # Larger than any node (e.g. DEP8 on 4-GPU trays): still keep it in one domain.
        return _place_in_domain(spec, cluster, free)
    raise PlacementError(
        f"{spec.role} group {spec.name!r} (DEP{spec.size}) needs {spec.size} free GPUs on one node; "
        f"after the groups placed before it, no node has that many free. Domains: {_domain_table(cluster, free)}"
    )


def make_plan(cluster: Cluster, layout: Layout) -> Plan:
    """Place every group of ``layout`` on ``cluster`` or raise PlacementError."""
    gpu_groups = [g for g in layout.groups if g.device == "cuda"]
    # The domain-size check comes first: "DEP32 cannot fit in an 8-GPU domain"
    # is the real problem even when the GPU total is also short.
    largest = cluster.largest_domain
    for g in gpu_groups:
        if g.span == "domain" and (largest is None or g.size > largest.num_gpus):
            _place_in_domain(g, cluster, {n.name: list(range(n.num_gpus)) for n in cluster.nodes})
    need = sum(g.size for g in gpu_groups)
    if need > cluster.num_gpus:
        parts = ", ".join(f"{g.name}={g.size}" for g in gpu_groups)
        raise PlacementError(
            f"the layout needs {need} GPUs ({parts}) but cluster {cluster.name or '?'!r} has {cluster.num_gpus}"
        )
    names = [g.name for g in layout.groups]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise PlacementError(f"group names must be unique; repeated: {dupes}")

    free = {n.name: list(range(n.num_gpus)) for n in cluster.nodes}
    warnings = list(cluster.warnings)
    placed: dict[str, GroupPlan] = {}
    # Domain-spanning groups first, biggest first: they are the hard constraint.
    order = sorted(gpu_groups, key=lambda g: (g.span != "domain", -g.size))
    for spec in order:
        slots = _place_in_domain(spec, cluster, free) if spec.span == "domain" else _place_on_node(spec, cluster, free)
        placed[spec.name] = GroupPlan(spec, slots)
        dom = slots[0].domain
        if spec.size > 1 and dom is not None and not cluster.domain(dom).nvlink:
            warnings.append(f"group {spec.name!r} spans GPUs without NVLink (domain {dom}): EP traffic goes over PCIe")
    for spec in layout.groups:
        if spec.device == "cpu":
            placed[spec.name] = GroupPlan(spec, [RankSlot(spec.name, r, None, None, None) for r in range(spec.size)])

    cpu_nodes = [n for n in cluster.nodes if not n.is_gpu]
    home = cpu_nodes[0] if cpu_nodes else max(cluster.nodes, key=lambda n: n.num_cpus)
    cpu_plans = []
    for actor in layout.cpu_actors:
        opts: dict[str, Any] = {"num_cpus": actor.num_cpus, "num_gpus": 0}
        if cpu_nodes:
            # Keep CPU actors off GPU nodes, whose CPUs feed the GPU ranks.
            opts["label_selector"] = {ROLE_LABEL: "cpu"}
        cpu_plans.append(CpuActorPlan(actor, home.name, opts))

    return Plan(
        cluster=cluster,
        groups=[placed[g.name] for g in layout.groups],
        cpu_actors=cpu_plans,
        rank_cpus=layout.rank_cpus,
        warnings=warnings,
    )


# ---------------------------------------------------------------------------
# Ray placement-group requests (plain dicts; no Ray import here)


def pg_request(plan: Plan, group: GroupPlan, domain_label: str = DOMAIN_LABEL, pin_nodes: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``ray.util.placement_group`` for one group.

    Bundle i is rank i. Ranks of a domain-span group carry a label selector
    naming their NVLink domain; when the plan came from a live Ray cluster (nodes know their Ray
    node id) and ``pin_nodes`` is set, each bundle is also pinned to its node,
    so the placement Ray makes is exactly the one printed by the dry run.
    Node-span groups use STRICT_PACK (one node); domain groups use PACK inside
    the domain selector, which Ray cannot honour partly: either the whole
    group fits in that domain or the group stays pending.
    """
    spec = group.spec
    bundles: list[dict[str, float]] = []
    selectors: list[dict[str, str]] = []
    for slot in group.slots:
        if spec.device == "cpu":
            bundles.append({"CPU": max(plan.rank_cpus, 1.0)})
            selectors.append({})
            continue
        bundle: dict[str, float] = {"GPU": 1.0}
        if plan.rank_cpus:
            bundle["CPU"] = float(plan.rank_cpus)
        bundles.append(bundle)
        node = plan.cluster.node(slot.node) if slot.node else None
        pinned = pin_nodes and node is not None and node.ray_node_id is not None
        sel: dict[str, str] = {}
        # A prefill group may land anywhere, so it names a domain only when
        # pinned to an exact node anyway. A domain inferred for a node that carries no
        # domain label (a lone HGX node) cannot be selected by label: the node pin does it.
        # Described clusters name their domains for nodes labelled that way when they start.
        labelled = node is None or node.ray_node_id is None or domain_label in node.labels
        if slot.domain and labelled and (spec.span == "domain" or pinned):
            sel[domain_label] = label_value(slot.domain)
        if pinned:
            sel[RAY_NODE_ID_LABEL] = node.ray_node_id
        selectors.append(sel)
    single_node = len(group.nodes) <= 1 and spec.device == "cuda"
    req: dict[str, Any] = {
        "bundles": bundles,
        "strategy": "STRICT_PACK" if single_node else "PACK",
        "name": spec.name,
    }
    if any(selectors):
        req["bundle_label_selector"] = selectors
    return req


def plan_rows(plan: Plan) -> list[dict[str, Any]]:
    """One row per rank and per CPU actor: the dry-run table's content."""
    rows: list[dict[str, Any]] = []
    for g in plan.groups:
        for s in g.slots:
            rows.append(
                {
                    "group": g.spec.name,
                    "role": g.spec.role,
                    "rank": s.rank,
                    "node": s.node or "(any)",
                    "gpu": "-" if s.gpu is None else s.gpu,
                    "domain": s.domain or "-",
                }
            )
    for a in plan.cpu_actors:
        rows.append(
            {
                "group": a.spec.name,
                "role": "cpu",
                "rank": "-",
                "node": a.node or "(any)",
                "gpu": "-",
                "domain": "-",
            }
        )
    return rows


def serve_replica_options(
    plan: Plan, role: str, domain_label: str = DOMAIN_LABEL, pin_nodes: bool = False
) -> dict[str, Any]:
    """Ray Serve deployment options giving each replica of ``role`` its own group.

    Serve creates one placement group per replica from these options, which
    is how autoscaled prefill groups get their GPUs: every replica is one
    group of the planned shape. Node pins are off by default because Serve
    decides at run time how many replicas exist and where.
    """
    groups = [g for g in plan.groups if g.spec.role == role]
    if not groups:
        raise PlacementError(f"the plan has no {role!r} group")
    req = pg_request(plan, groups[0], domain_label, pin_nodes)
    opts: dict[str, Any] = {
        "placement_group_bundles": req["bundles"],
        "placement_group_strategy": req["strategy"],
    }
    if req.get("bundle_label_selector"):
        opts["placement_group_bundle_label_selector"] = req["bundle_label_selector"]
    return opts
