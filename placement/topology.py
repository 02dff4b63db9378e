"""GPU topology model: nodes, their GPUs, and the NVLink domains they form.

An NVLink domain is the set of GPUs that reach each other over NVLink without
touching PCIe or the network. On an HGX board that is one 8-GPU node; on a
GB200/GB300 NVL72 rack it is 72 GPUs spread over 18 compute trays (nodes).
Wide-EP decode only pays off inside one domain, so the planner reasons in
domains first and nodes second.

Pure standard library on purpose: the discovery command runs on GPU hosts that
have neither Ray nor pydantic nor PyYAML.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

# Ray node labels this project reads and writes. "ray.io/" keys are reserved
# for Ray itself, so ours live under a project prefix.
DOMAIN_LABEL = "wideep.io/nvlink-domain"
ROLE_LABEL = "wideep.io/role"  # "gpu" or "cpu"
GPU_MODEL_LABEL = "wideep.io/gpu-model"
RAY_NODE_ID_LABEL = "ray.io/node-id"

_LABEL_VALUE_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")


class TopologyError(ValueError):
    """A cluster description (or a live cluster) that cannot be modelled."""


def label_value(text: str) -> str:
    """Turn arbitrary text (a hostname, a UUID) into a valid Ray label value.

    Ray label values follow Kubernetes rules: at most 63 characters,
    alphanumeric at both ends, only ``-_.`` inside. Long inputs keep a hash
    suffix so two different long hostnames never collapse onto one value.
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-_.")
    if not cleaned:
        cleaned = "x"
    if len(cleaned) > 63:
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        cleaned = cleaned[:54].rstrip("-_.") + "-" + digest
    return cleaned


@dataclass
class Node:
    """One machine (a Ray node). ``domain`` is None for CPU-only nodes."""

    name: str
    num_gpus: int = 0
    num_cpus: float = 0.0
    gpu_model: str = ""
    domain: str | None = None
    # False when the node's GPUs only meet over PCIe: such a "domain" still
    # exists for bookkeeping, but Wide-EP on it gets a warning.
    nvlink: bool = True
    labels: dict[str, str] = field(default_factory=dict)
    # Set only for nodes read from a running Ray cluster; lets a plan pin
    # bundles to exact nodes instead of just to a domain.
    ray_node_id: str | None = None

    @property
    def is_gpu(self) -> bool:
        return self.num_gpus > 0

    def ray_labels(self) -> dict[str, str]:
        """The labels a Ray node of this shape should be started with."""
        out = dict(self.labels)
        out[ROLE_LABEL] = "gpu" if self.is_gpu else "cpu"
        if self.domain is not None:
            out[DOMAIN_LABEL] = label_value(self.domain)
        if self.gpu_model:
            out[GPU_MODEL_LABEL] = label_value(self.gpu_model)
        return out


@dataclass
class Domain:
    """An NVLink domain: whole nodes whose GPUs are all NVLink peers."""

    id: str
    nodes: list[Node]

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @property
    def nvlink(self) -> bool:
        return all(n.nvlink for n in self.nodes)

    @property
    def kind(self) -> str:
        if not self.nvlink:
            return "pcie"
        if len(self.nodes) > 1:
            return "multi-node NVLink"
        return "single-node NVLink"


@dataclass
class Cluster:
    """Nodes grouped into NVLink domains. ``source`` says where it came from."""

    nodes: list[Node]
    name: str = ""
    source: str = "described"
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise TopologyError(f"cluster {self.name!r}: node name {node.name!r} appears twice")
            seen.add(node.name)
            if node.num_gpus < 0:
                raise TopologyError(f"node {node.name!r}: gpus must be >= 0, got {node.num_gpus}")
            if node.num_gpus == 0:
                node.domain = None

    @property
    def domains(self) -> list[Domain]:
        by_id: dict[str, list[Node]] = {}
        for node in self.nodes:
            if node.domain is not None:
                by_id.setdefault(node.domain, []).append(node)
        return [Domain(d, ns) for d, ns in by_id.items()]

    def domain(self, domain_id: str) -> Domain:
        for d in self.domains:
            if d.id == domain_id:
                return d
        raise KeyError(domain_id)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    @property
    def largest_domain(self) -> Domain | None:
        ds = self.domains
        return max(ds, key=lambda d: d.num_gpus) if ds else None

    def summary(self) -> str:
        doms = self.domains
        head = (
            f"{self.name or 'cluster'} ({self.source}): {len(self.nodes)} node(s), "
            f"{self.num_gpus} GPU(s), {len(doms)} NVLink domain(s)"
        )
        lines = [head]
        for d in sorted(doms, key=lambda d: (-d.num_gpus, d.id)):
            models = sorted({n.gpu_model for n in d.nodes if n.gpu_model})
            lines.append(
                f"  domain {d.id}: {d.num_gpus} GPU(s) on {len(d.nodes)} node(s), "
                f"{d.kind}{' [' + ', '.join(models) + ']' if models else ''}"
            )
        cpu_nodes = [n.name for n in self.nodes if not n.is_gpu]
        if cpu_nodes:
            lines.append(f"  CPU-only node(s): {', '.join(cpu_nodes)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "nodes": [
                {
                    "name": n.name,
                    "gpus": n.num_gpus,
                    "cpus": n.num_cpus,
                    "gpu_model": n.gpu_model,
                    "domain": n.domain,
                    "nvlink": n.nvlink,
                    **({"ray_node_id": n.ray_node_id} if n.ray_node_id else {}),
                }
                for n in self.nodes
            ],
        }


# ---------------------------------------------------------------------------
# Described clusters (a YAML file or an inline mapping in the serve config)

_NODE_KEYS = {"name", "count", "gpus", "cpus", "gpu_model", "domain", "nvlink", "labels"}
_CLUSTER_KEYS = {"name", "nodes"}


def _as_int(value: Any, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TopologyError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def cluster_from_description(desc: Mapping[str, Any], source: str = "described") -> Cluster:
    """Build a Cluster from a described layout.

    Shape::

        name: gb300-nvl72
        nodes:
          - {name: head, cpus: 32}                  # CPU-only
          - name: tray                              # expands to tray-00 .. tray-17
            count: 18
            gpus: 4
            gpu_model: GB300
            domain: rack0                           # all 18 trays: one domain

    A GPU node without ``domain`` is its own domain (the HGX case).
    """
    if not isinstance(desc, Mapping):
        raise TopologyError(f"cluster description must be a mapping, got {type(desc).__name__}")
    unknown = set(desc) - _CLUSTER_KEYS
    if unknown:
        raise TopologyError(
            f"cluster description: unknown key(s) {sorted(unknown)} (known: {sorted(_CLUSTER_KEYS)})"
        )
    entries = desc.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise TopologyError("cluster description: 'nodes' must be a non-empty list")
    nodes: list[Node] = []
    for i, entry in enumerate(entries):
        where = f"cluster description: nodes[{i}]"
        if not isinstance(entry, Mapping):
            raise TopologyError(f"{where}: expected a mapping, got {entry!r}")
        unknown = set(entry) - _NODE_KEYS
        if unknown:
            raise TopologyError(
                f"{where} ({entry.get('name', '?')!r}): unknown key(s) {sorted(unknown)} "
                f"(known: {sorted(_NODE_KEYS)})"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise TopologyError(f"{where}: 'name' is required and must be a string")
        count = _as_int(entry.get("count", 1), f"{where} ({name!r}).count", 1)
        gpus = _as_int(entry.get("gpus", 0), f"{where} ({name!r}).gpus")
        cpus = entry.get("cpus", 0)
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
            raise TopologyError(f"{where} ({name!r}).cpus: expected a number >= 0, got {cpus!r}")
        labels = entry.get("labels", {}) or {}
        if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            raise TopologyError(f"{where} ({name!r}).labels: expected a string -> string mapping")
        nvlink = entry.get("nvlink", True)
        if not isinstance(nvlink, bool):
            raise TopologyError(f"{where} ({name!r}).nvlink: expected true/false, got {nvlink!r}")
        domain = entry.get("domain")
        if domain is not None and not isinstance(domain, str):
            raise TopologyError(f"{where} ({name!r}).domain: expected a string, got {domain!r}")
        if domain is None:
            domain = labels.get(DOMAIN_LABEL)
        width = max(2, len(str(count - 1)))
        for k in range(count):
            node_name = name if count == 1 else f"{name}-{k:0{width}d}"
            nodes.append(
                Node(
                    name=node_name,
                    num_gpus=gpus,
                    num_cpus=float(cpus),
                    gpu_model=str(entry.get("gpu_model", "") or ""),
                    domain=(domain or node_name) if gpus else None,
                    nvlink=nvlink,
                    labels=dict(labels),
                )
            )
    return Cluster(nodes=nodes, name=str(desc.get("name", "") or ""), source=source)


# ---------------------------------------------------------------------------
# Live Ray clusters: the list that ``ray.nodes()`` returns, read without Ray.


def cluster_from_ray_nodes(ray_nodes: Iterable[Mapping[str, Any]], domain_label: str = DOMAIN_LABEL) -> Cluster:
    """Model a running Ray cluster from its node table.

    A GPU node without a domain label is treated as its own domain (what an
    HGX node is) and a warning says so, because a multi-node NVL72 domain
    cannot be inferred from Ray's view alone.
    """
    nodes: list[Node] = []
    warnings: list[str] = []
    for entry in ray_nodes:
        if not entry.get("Alive", True):
            continue
        node_id = str(entry["NodeID"])
        resources = entry.get("Resources", {}) or {}
        labels = dict(entry.get("Labels", {}) or {})
        gpus = int(resources.get("GPU", 0))
        host = entry.get("NodeManagerHostname") or entry.get("NodeManagerAddress") or ""
        name = f"{node_id[:8]}" + (f"@{host}" if host else "")
        domain = labels.get(domain_label)
        if gpus and not domain:
            domain = f"node-{node_id[:12]}"
            warnings.append(
                f"node {name} has {gpus} GPU(s) but no {domain_label!r} label: "
                "treated as its own NVLink domain"
            )
        nodes.append(
            Node(
                name=name,
                num_gpus=gpus,
                num_cpus=float(resources.get("CPU", 0)),
                gpu_model=labels.get(GPU_MODEL_LABEL, labels.get("ray.io/accelerator-type", "")),
                domain=domain if gpus else None,
                labels=labels,
                ray_node_id=node_id,
            )
        )
    if not nodes:
        raise TopologyError("the Ray cluster reports no live nodes")
    return Cluster(nodes=nodes, name="ray", source="ray", warnings=warnings)
