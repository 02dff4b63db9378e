"""Find this machine's GPUs and the NVLink domain they belong to.

Sources, in order: NVML (the ``nvidia-ml-py`` package, imported as
``pynvml``), then the ``nvidia-smi`` command (``topo -m`` for NVLink peers,
``-q`` for GPU names, UUIDs and the fabric fields of multi-node NVLink
systems). When neither answers, the report says "not found" and callers fall
back to a described cluster; nothing here raises because a GPU is missing.

Domain identity:
- GB200/GB300 NVL72 (multi-node NVLink): every GPU's fabric reports
  ``ClusterUUID`` and ``CliqueId``; GPUs sharing both share a domain, across
  trays. The domain id is built from those two values.
- HGX and other single-node NVLink boards: the fabric fields are absent or
  zero; the domain is this host, provided all its GPUs are NVLink peers.

Standard library only (plus optional pynvml): this runs on GPU hosts that have
no Ray, pydantic or PyYAML.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import socket
import subprocess
from typing import Any

from placement.topology import Cluster, Node, label_value

NOT_FOUND = "not found"
_ZERO_UUID = "00000000-0000-0000-0000-000000000000"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


# ---------------------------------------------------------------------------
# nvidia-smi topo -m


def parse_topo_matrix(text: str) -> dict[str, Any]:
    """Parse ``nvidia-smi topo -m``.

    Returns ``{"gpus": ["GPU0", ...], "links": {(i, j): "NV18" | "SYS" | ...},
    "cpu_affinity": {i: "0-55,112-167"}, "numa": {i: "0"}}`` over GPU rows
    only (NIC rows and columns are skipped). Raises ValueError when the text
    holds no GPU matrix, naming what it expected.
    """
    lines = [_ANSI_RE.sub("", ln).rstrip("\n") for ln in text.splitlines()]
    header_idx = None
    for i, ln in enumerate(lines):
        cells = [c.strip() for c in ln.split("\t")]
        # The header row is the one whose first cell (above the row labels) is empty.
        if cells[0] == "" and "GPU0" in cells:
            header_idx = i
            break
    if header_idx is None:
        raise ValueError("nvidia-smi topo -m output: no header row with a 'GPU0' column found")
    header = [c.strip() for c in lines[header_idx].split("\t")][1:]
    gpu_cols = [c for c in header if re.fullmatch(r"GPU\d+", c)]
    col_index = {c: k for k, c in enumerate(header)}
    links: dict[tuple[int, int], str] = {}
    cpu_aff: dict[int, str] = {}
    numa: dict[int, str] = {}
    for ln in lines[header_idx + 1 :]:
        if not ln.strip():
            break
        cells = [c.strip() for c in ln.split("\t")]
        row = cells[0]
        if not re.fullmatch(r"GPU\d+", row):
            continue
        i = int(row[3:])
        values = cells[1:]
        for col in gpu_cols:
            k = col_index[col]
            if k < len(values):
                j = int(col[3:])
                if i != j:
                    links[(i, j)] = values[k]
        if "CPU Affinity" in col_index and col_index["CPU Affinity"] < len(values):
            cpu_aff[i] = values[col_index["CPU Affinity"]]
        if "NUMA Affinity" in col_index and col_index["NUMA Affinity"] < len(values):
            numa[i] = values[col_index["NUMA Affinity"]]
    if not gpu_cols:
        raise ValueError("nvidia-smi topo -m output: header has no GPU columns")
    return {"gpus": gpu_cols, "links": links, "cpu_affinity": cpu_aff, "numa": numa}


def nvlink_islands(num_gpus: int, links: dict[tuple[int, int], str]) -> list[list[int]]:
    """Group GPU indices into sets connected by NVLink (``NV<n>`` entries)."""
    parent = list(range(num_gpus))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (i, j), kind in links.items():
        if kind.startswith("NV") and i < num_gpus and j < num_gpus:
            parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for g in range(num_gpus):
        groups.setdefault(find(g), []).append(g)
    return sorted(groups.values())


# ---------------------------------------------------------------------------
# nvidia-smi -q


def parse_query(text: str) -> list[dict[str, Any]]:
    """Parse ``nvidia-smi -q`` into one dict per GPU, in output order.

    Keeps what placement needs: bus id, product name, UUID, framebuffer total
    and the Fabric section (state, status, clique id, cluster UUID). Values
    reported as ``N/A`` become None.
    """
    gpus: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    section: list[tuple[int, str]] = []  # (indent, title) stack inside a GPU
    for raw in text.splitlines():
        line = _ANSI_RE.sub("", raw).rstrip()
        if not line.strip():
            continue
        m = re.match(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$", line)
        if m:
            cur = {"bus_id": m.group(1), "fabric": {}}
            gpus.append(cur)
            section = []
            continue
        if cur is None:
            continue
        indent = len(line) - len(line.lstrip())
        while section and section[-1][0] >= indent:
            section.pop()
        if ":" not in line:
            section.append((indent, line.strip()))
            continue
        key, _, value = line.strip().partition(":")
        key, value = key.strip(), value.strip()
        val: str | None = None if value in ("N/A", "") else value
        path = [t for _, t in section]
        if not path:
            if key == "Product Name":
                cur["name"] = val
            elif key == "GPU UUID":
                cur["uuid"] = val
            elif key == "Minor Number" and val is not None and val.isdigit():
                cur["minor"] = int(val)
        elif path == ["FB Memory Usage"] and key == "Total" and val:
            m2 = re.match(r"(\d+)\s*MiB", val)
            if m2:
                cur["memory_mib"] = int(m2.group(1))
        elif path == ["Fabric"]:
            field_name = {
                "State": "state",
                "Status": "status",
                "CliqueId": "clique_id",
                "ClusterUUID": "cluster_uuid",
            }.get(key)
            if field_name:
                cur["fabric"][field_name] = val
    return gpus


def fabric_domain(fabric: dict[str, Any]) -> str | None:
    """The multi-node domain id a GPU's fabric fields name, or None.

    Only a completed fabric registration with a non-zero cluster UUID names a
    domain that can reach past this node.
    """
    uuid = (fabric.get("cluster_uuid") or "").lower()
    clique = fabric.get("clique_id")
    state = (fabric.get("state") or "").lower()
    if not uuid or uuid == _ZERO_UUID or clique is None:
        return None
    if state and state != "completed":
        return None
    return label_value(f"nvl-{uuid}-{clique}")


# ---------------------------------------------------------------------------
# Probing


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout


def _nvml_fabric(pynvml: Any, handle: Any) -> dict[str, Any]:
    """Fabric fields through NVML; {} where the GPU or the binding has none.

    nvidia-ml-py fills a caller-made struct. The versioned call (v2 struct,
    16-byte UUID) is tried first; the plain one is the fallback for older
    bindings.
    """
    attempts = []
    v2_cls, v2_ver = getattr(pynvml, "c_nvmlGpuFabricInfo_v2_t", None), getattr(pynvml, "nvmlGpuFabricInfo_v2", None)
    if v2_cls is not None and v2_ver is not None and hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV"):
        attempts.append((pynvml.nvmlDeviceGetGpuFabricInfoV, v2_cls, v2_ver))
    v1_cls = getattr(pynvml, "c_nvmlGpuFabricInfo_t", None)
    if v1_cls is not None and hasattr(pynvml, "nvmlDeviceGetGpuFabricInfo"):
        attempts.append((pynvml.nvmlDeviceGetGpuFabricInfo, v1_cls, None))
    for fn, cls, version in attempts:
        info = cls()
        if version is not None:
            info.version = version
        try:
            fn(handle, ctypes.byref(info))
        except Exception:  # pre-Hopper GPUs and old drivers answer "not supported"
            continue
        raw = bytes(info.clusterUuid)[:16]
        h = raw.hex()
        uuid = f"{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}" if len(h) == 32 else None
        completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
        return {
            "state": "Completed" if info.state == completed else f"state {info.state}",
            "status": "Success" if info.status == 0 else f"status {info.status}",
            "clique_id": str(info.cliqueId),
            "cluster_uuid": uuid,
        }
    return {}


def _probe_nvml() -> dict[str, Any] | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = []
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            gpus.append(
                {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "memory_mib": int(mem),
                    "bus_id": bus.decode() if isinstance(bus, bytes) else bus,
                    "fabric": _nvml_fabric(pynvml, h),
                }
            )
        links: dict[tuple[int, int], str] = {}
        nvlink_idx = getattr(pynvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
        ok = getattr(pynvml, "NVML_P2P_STATUS_OK", 0)
        for i in range(count):
            for j in range(count):
                if i == j:
                    continue
                try:
                    status = pynvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], nvlink_idx)
                except Exception:
                    status = None
                links[(i, j)] = "NV" if status == ok else "PCIe"
        return {"source": "nvml", "gpus": gpus, "links": links}
    except Exception as exc:
        return {"source": "nvml", "error": f"{type(exc).__name__}: {exc}", "gpus": [], "links": {}}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _probe_nvidia_smi() -> dict[str, Any] | None:
    query = _run(["nvidia-smi", "-q"])
    if query is None:
        return None
    gpus = parse_query(query)
    for i, g in enumerate(gpus):
        g.setdefault("index", i)
    links: dict[tuple[int, int], str] = {}
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo is not None:
        try:
            links = parse_topo_matrix(topo)["links"]
        except ValueError:
            links = {}
    return {"source": "nvidia-smi", "gpus": gpus, "links": links}


def build_report(probe: dict[str, Any] | None, hostname: str) -> dict[str, Any]:
    """Turn raw probe results into the JSON-able discovery report.

    Split from probing so fixture files can drive it in tests.
    """
    if probe is None or not probe.get("gpus"):
        reason = (probe or {}).get("error") or "no NVIDIA driver, NVML or nvidia-smi answered"
        return {
            "status": NOT_FOUND,
            "reason": reason,
            "source": (probe or {}).get("source"),
            "hostname": hostname,
            "gpus": [],
            "num_gpus": 0,
            "nvlink_islands": [],
            "domain": None,
            "domain_kind": None,
        }
    gpus = probe["gpus"]
    n = len(gpus)
    links = probe.get("links") or {}
    # No link table (topo -m failed) means NVLink peers are unknown, not absent.
    islands = nvlink_islands(n, links) if links else None
    fabric_ids = {fabric_domain(g.get("fabric") or {}) for g in gpus}
    warnings: list[str] = []
    if len(fabric_ids) == 1 and None not in fabric_ids:
        domain, kind = fabric_ids.pop(), "multi-node NVLink"
    else:
        if len(fabric_ids - {None}) > 1:
            warnings.append(f"GPUs of this node report different fabric cliques: {sorted(fabric_ids - {None})}")
        domain = label_value(f"node-{hostname}")
        if n == 1:
            kind = "single GPU"
        elif islands is None:
            kind = "single-node NVLink"
            warnings.append("GPU links unknown (nvidia-smi topo -m gave nothing): NVLink between them is assumed")
        elif len(islands) == 1:
            kind = "single-node NVLink"
        else:
            kind = "pcie"
            warnings.append(
                f"GPUs are not all NVLink peers (islands {islands}); Wide-EP across them goes over PCIe"
            )
    models = sorted({str(g.get("name") or "unknown model") for g in gpus})
    return {
        "status": "found",
        "source": probe["source"],
        "hostname": hostname,
        "num_gpus": n,
        "gpu_model": models[0] if len(models) == 1 else ",".join(models),
        "gpus": gpus,
        "nvlink_islands": islands,
        "domain": domain,
        "domain_kind": kind,
        "warnings": warnings,
    }


def discover_local(use_nvml: bool = True) -> dict[str, Any]:
    """Probe this host. Never raises for a missing GPU stack."""
    hostname = socket.gethostname()
    probe = None
    if use_nvml:
        probe = _probe_nvml()
        if probe is not None and not probe.get("gpus"):
            probe = None  # NVML imported but found nothing usable: ask nvidia-smi
    if probe is None:
        probe = _probe_nvidia_smi()
    elif not any(g.get("fabric") for g in probe["gpus"]):
        # A binding too old for the fabric call must not turn an NVL72 tray
        # into a one-node domain: take the fabric fields from nvidia-smi.
        query = _run(["nvidia-smi", "-q"])
        by_bus = {g["bus_id"].lower(): g.get("fabric") or {} for g in parse_query(query or "")}
        for g in probe["gpus"]:
            g["fabric"] = by_bus.get(str(g.get("bus_id", "")).lower(), {})
    return build_report(probe, hostname)


def short_model(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA GB200' -> 'GB200' (for labels)."""
    name = name.replace("NVIDIA", "").strip()
    return name.split()[0] if name else ""


def cluster_from_discovery(report: dict[str, Any]) -> Cluster:
    """A one-node Cluster from a discovery report (must have found GPUs)."""
    if report.get("status") != "found":
        raise ValueError(f"GPU discovery: {NOT_FOUND} ({report.get('reason')}); describe the cluster instead")
    node = Node(
        name=label_value(report["hostname"]),
        num_gpus=report["num_gpus"],
        gpu_model=short_model(report.get("gpu_model", "")),
        domain=report["domain"],
        nvlink=report["domain_kind"] != "pcie",
    )
    return Cluster(nodes=[node], name=report["hostname"], source=f"discovered via {report['source']}")


def node_labels(report: dict[str, Any]) -> dict[str, str]:
    """Ray labels for this host, for ``ray start --labels-file``."""
    if report.get("status") != "found":
        return Node(name="cpu", num_gpus=0).ray_labels()
    return cluster_from_discovery(report).nodes[0].ray_labels()
