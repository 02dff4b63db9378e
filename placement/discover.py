"""``python -m placement.discover``: what GPUs and NVLink domain this host has.

Prints a readable summary, then the whole report as one JSON object after a
``--- json ---`` line (``--json`` prints only the JSON). ``--labels-file``
writes the Ray node labels for ``ray start --labels-file`` (cluster.yaml's
worker start command uses it). ``--topo FILE`` / ``--query FILE`` read saved
``nvidia-smi topo -m`` / ``nvidia-smi -q`` output instead of probing.

Exit status is 0 whether or not GPUs were found: "not found" is an answer.
Standard library only, plus ``pynvml`` when installed.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

from placement import discovery


def _summary(report: dict[str, Any]) -> str:
    if report["status"] != "found":
        return (
            f"host {report['hostname']}: GPUs {discovery.NOT_FOUND} ({report['reason']}).\n"
            "Describe the cluster in a YAML file instead (see configs/clusters/)."
        )
    lines = [
        f"host {report['hostname']}: {report['num_gpus']} x {report['gpu_model']} (via {report['source']})",
        f"NVLink domain: {report['domain']} ({report['domain_kind']})",
        f"NVLink islands on this host: {report['nvlink_islands'] if report['nvlink_islands'] is not None else 'unknown'}",
    ]
    for g in report["gpus"]:
        fab = g.get("fabric") or {}
        fab_txt = ""
        if fab.get("cluster_uuid") or fab.get("state"):
            fab_txt = (
                f"  fabric state={fab.get('state')} clique={fab.get('clique_id')} "
                f"cluster={fab.get('cluster_uuid')}"
            )
        mem = f" {g['memory_mib'] // 1024} GiB" if g.get("memory_mib") else ""
        lines.append(f"  GPU{g.get('index', '?')} {g.get('name')}{mem} {g.get('bus_id', '')} {g.get('uuid', '')}{fab_txt}")
    for w in report.get("warnings", []):
        lines.append(f"warning: {w}")
    lines.append("Ray node labels: " + ", ".join(f"{k}={v}" for k, v in discovery.node_labels(report).items()))
    return "\n".join(lines)


def _jsonable(report: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(report, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m placement.discover", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON report")
    ap.add_argument("--labels-file", help="write Ray node labels (YAML-compatible 'key: value' lines) here")
    ap.add_argument("--no-nvml", action="store_true", help="skip NVML, ask nvidia-smi directly")
    ap.add_argument("--topo", help="parse this saved 'nvidia-smi topo -m' output instead of probing")
    ap.add_argument("--query", help="parse this saved 'nvidia-smi -q' output instead of probing")
    args = ap.parse_args(argv)

    if args.topo or args.query:
        probe: dict[str, Any] = {"source": "saved nvidia-smi output", "gpus": [], "links": {}}
        if args.query:
            with open(args.query) as f:
                probe["gpus"] = discovery.parse_query(f.read())
        if args.topo:
            with open(args.topo) as f:
                topo = discovery.parse_topo_matrix(f.read())
            probe["links"] = topo["links"]
            if not probe["gpus"]:
                probe["gpus"] = [{"index": int(c[3:]), "name": "", "fabric": {}} for c in topo["gpus"]]
        for i, g in enumerate(probe["gpus"]):
            g.setdefault("index", i)
        report = discovery.build_report(probe, socket.gethostname())
    else:
        report = discovery.discover_local(use_nvml=not args.no_nvml)

    # JSON has no tuple keys; links are summarised by the islands anyway.
    report = _jsonable(report)
    if args.labels_file:
        labels = discovery.node_labels(report)
        with open(args.labels_file, "w") as f:
            for k, v in labels.items():
                f.write(f'"{k}": "{v}"\n')
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_summary(report))
        print("--- json ---")
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head` closed stdout early; nothing is wrong
        sys.stderr.close()
        sys.exit(0)
