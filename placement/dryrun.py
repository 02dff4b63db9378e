"""Dry run: print where every rank of a serve config would go on a cluster.

    python -m placement --config configs/h200x8.yaml --cluster configs/clusters/h200x8.yaml
    python -m placement --config configs/h200x2.yaml --cluster discover
    python -m placement --config configs/gb300-nvl72.yaml --cluster ray     # a running Ray cluster

Without ``--cluster`` the config's own ``placement.cluster`` is used. Exit
status: 0 when everything fits, 1 when the layout cannot be placed (the
message says why), 2 for a bad config or cluster description.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from placement import discovery
from placement.plan import Plan, PlacementError, make_plan, pg_request, plan_rows
from placement.topology import Cluster, TopologyError, cluster_from_description, cluster_from_ray_nodes


def load_cluster_file(path: str | Path) -> Cluster:
    """Read a described-cluster YAML file (see configs/clusters/)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise TopologyError(f"cluster description {str(p)!r}: file not found") from None
    except yaml.YAMLError as e:
        raise TopologyError(f"cluster description {str(p)!r}: not valid YAML: {e}") from None
    try:
        cluster = cluster_from_description(data, source=f"described in {p.name}")
    except TopologyError as e:
        raise TopologyError(f"{p}: {e}") from None
    if not cluster.name:
        cluster.name = p.stem
    return cluster


def live_ray_cluster(domain_label: str) -> Cluster:
    """Model the Ray cluster this process is (or can get) connected to."""
    import ray

    if not ray.is_initialized():
        try:
            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        except ConnectionError:
            raise TopologyError(
                "cluster 'ray': no running Ray cluster found to read nodes from; "
                "start one (`ray up cluster.yaml`) or pass --cluster with a described-cluster YAML or 'discover'"
            ) from None
    return cluster_from_ray_nodes(ray.nodes(), domain_label)


def resolve_cluster(spec: Any, domain_label: str, base_dir: Path | None = None) -> Cluster:
    """'discover' | 'ray' | path to YAML | inline mapping -> Cluster."""
    if isinstance(spec, dict):
        return cluster_from_description(spec, source="inline description")
    if spec == "discover":
        report = discovery.discover_local()
        try:
            return discovery.cluster_from_discovery(report)
        except ValueError as e:
            raise TopologyError(str(e)) from None
    if spec == "ray":
        return live_ray_cluster(domain_label)
    path = Path(spec)
    if base_dir is not None and not path.is_absolute() and not path.exists() and (base_dir / path).exists():
        path = base_dir / path
    return load_cluster_file(path)


def format_plan(plan: Plan, domain_label: str) -> str:
    rows = plan_rows(plan)
    cols = ["group", "role", "rank", "node", "gpu", "domain"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    out = [plan.cluster.summary(), ""]
    out.append("  ".join(c.ljust(widths[c]) for c in cols).rstrip())
    out.append("  ".join("-" * widths[c] for c in cols))
    for r in rows:
        out.append("  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip())
    out.append("")
    out.append("placement groups (bundle i = rank i):")
    for g in plan.groups:
        req = pg_request(plan, g, domain_label)
        bundle = req["bundles"][0]
        sel = req.get("bundle_label_selector")
        where = "any node" if not sel else ", ".join(sorted({f"{k}={v}" for s in sel for k, v in s.items()}))
        out.append(f"  {g.spec.name}: {len(req['bundles'])} x {bundle} {req['strategy']} on {where}")
    for a in plan.cpu_actors:
        out.append(f"  {a.spec.name}: actor options {a.ray_options}")
    out.append("")
    out.append(f"GPUs used: {plan.gpus_used} of {plan.cluster.num_gpus}")
    for w in plan.warnings:
        out.append(f"warning: {w}")
    return "\n".join(out)


def plan_json(plan: Plan, domain_label: str) -> dict[str, Any]:
    return {
        "cluster": plan.cluster.to_dict(),
        "ranks": plan_rows(plan),
        "placement_groups": [pg_request(plan, g, domain_label) for g in plan.groups],
        "cpu_actors": [{"name": a.spec.name, "node": a.node, "options": a.ray_options} for a in plan.cpu_actors],
        "gpus_used": plan.gpus_used,
        "warnings": plan.warnings,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m placement", description="Placement dry run for a serve config.")
    ap.add_argument("--config", required=True, help="Ray Serve config YAML with the wideep application")
    ap.add_argument("--cluster", help="described-cluster YAML, 'discover' (this host) or 'ray' (running cluster)")
    ap.add_argument("--app", help="application name inside the serve config (default: the app.main one)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)

    from app.config import ConfigError, load_serve_config

    try:
        _, cfg = load_serve_config(args.config, args.app)
        label = cfg.placement.domain_label
        spec = args.cluster if args.cluster else cfg.placement.cluster
        cluster = resolve_cluster(spec, label, base_dir=Path(args.config).resolve().parent.parent)
    except (ConfigError, TopologyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        plan = make_plan(cluster, cfg.layout())
    except PlacementError as e:
        print(cluster.summary(), file=sys.stderr)
        print(f"error: cannot place {args.config}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan_json(plan, label), indent=2))
    else:
        print(f"config: {args.config}")
        print(format_plan(plan, label))
    return 0
