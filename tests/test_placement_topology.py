"""Topology model and GPU discovery (no Ray, no GPU needed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from placement import discovery
from placement.topology import (
    DOMAIN_LABEL,
    ROLE_LABEL,
    TopologyError,
    cluster_from_description,
    cluster_from_ray_nodes,
    label_value,
)

ROOT = Path(__file__).resolve().parents[1]
FIX = Path(__file__).parent / "fixtures" / "nvidia-smi"


# --- described clusters ------------------------------------------------------


def test_hgx_node_is_its_own_domain_and_head_has_none():
    c = cluster_from_description(
        {"name": "x", "nodes": [{"name": "head", "cpus": 8}, {"name": "hgx", "count": 2, "gpus": 8, "gpu_model": "H200"}]}
    )
    assert [n.name for n in c.nodes] == ["head", "hgx-00", "hgx-01"]
    assert c.node("head").domain is None
    assert sorted(d.id for d in c.domains) == ["hgx-00", "hgx-01"]
    assert c.largest_domain.num_gpus == 8
    assert c.num_gpus == 16
    assert c.node("head").ray_labels() == {ROLE_LABEL: "cpu"}
    assert c.node("hgx-01").ray_labels()[DOMAIN_LABEL] == "hgx-01"


def test_nvl72_rack_is_one_domain_over_18_nodes():
    c = cluster_from_description(
        {"nodes": [{"name": "tray", "count": 18, "gpus": 4, "gpu_model": "GB300", "domain": "rack0"}]}
    )
    (d,) = c.domains
    assert (d.id, d.num_gpus, len(d.nodes), d.kind) == ("rack0", 72, 18, "multi-node NVLink")
    assert "72 GPU(s) on 18 node(s)" in c.summary()


@pytest.mark.parametrize(
    "desc, needle",
    [
        ({"nodes": [{"name": "a", "gpu": 8}]}, "unknown key(s) ['gpu']"),
        ({"nodes": [{"name": "a", "gpus": -1}]}, "gpus: expected an integer >= 0"),
        ({"nodes": [{"name": "a", "gpus": "8"}]}, "gpus: expected an integer"),
        ({"nodes": [{"gpus": 8}]}, "'name' is required"),
        ({"nodes": []}, "'nodes' must be a non-empty list"),
        ({"nodes": [{"name": "a"}, {"name": "a"}]}, "node name 'a' appears twice"),
        ({"nodes": [{"name": "a"}], "racks": 1}, "unknown key(s) ['racks']"),
        ({"nodes": [{"name": "a", "count": 0}]}, "count: expected an integer >= 1"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_bad_descriptions_name_the_problem(desc, needle):
    with pytest.raises(TopologyError) as e:
        cluster_from_description(desc)
    assert needle in str(e.value)


def test_label_values_are_valid_and_distinct():
    long_a = "a" * 80 + ".example.com"
    long_b = "a" * 80 + ".example.org"
    va, vb = label_value(long_a), label_value(long_b)
    assert len(va) <= 63 and len(vb) <= 63 and va != vb
    assert label_value("node_1.lan") == "node_1.lan"
    assert label_value("weird host!") == "weird-host"


def test_cluster_from_ray_nodes_reads_labels_and_skips_dead():
    nodes = [
        {"NodeID": "aa" * 28, "Alive": True, "Resources": {"CPU": 4.0}, "Labels": {ROLE_LABEL: "cpu"}},
        {"NodeID": "bb" * 28, "Alive": True, "Resources": {"CPU": 0.0, "GPU": 4.0}, "Labels": {DOMAIN_LABEL: "r0"}},
        {"NodeID": "cc" * 28, "Alive": True, "Resources": {"GPU": 4.0}, "Labels": {DOMAIN_LABEL: "r0"}},
        {"NodeID": "dd" * 28, "Alive": True, "Resources": {"GPU": 8.0}, "Labels": {}},
        {"NodeID": "ee" * 28, "Alive": False, "Resources": {"GPU": 8.0}, "Labels": {}},
    ]
    c = cluster_from_ray_nodes(nodes)
    assert len(c.nodes) == 4
    doms = {d.id: d.num_gpus for d in c.domains}
    assert doms == {"r0": 8, "node-dddddddddddd": 8}
    assert any("no 'wideep.io/nvlink-domain' label" in w for w in c.warnings)
    assert all(n.ray_node_id for n in c.nodes)


# --- nvidia-smi parsing --------------------------------------------------------


def test_topo_hgx_h200x8_is_one_nvlink_island():
    t = discovery.parse_topo_matrix((FIX / "topo-m_hgx-h200x8.txt").read_text())
    assert t["gpus"] == [f"GPU{i}" for i in range(8)]
    assert len(t["links"]) == 56 and set(t["links"].values()) == {"NV18"}
    assert t["cpu_affinity"][0] == "0-47,96-143" and t["numa"][7] == "1"
    assert discovery.nvlink_islands(8, t["links"]) == [list(range(8))]


def test_topo_two_gpu_node_recorded_with_terminal_codes():
    text = (FIX / "topo-m_h200x2.txt").read_text()
    assert "\x1b[4m" in text  # nvidia-smi underlines the header, even into a file
    t = discovery.parse_topo_matrix(text)
    assert t["gpus"] == ["GPU0", "GPU1"] and t["links"] == {(0, 1): "NV18", (1, 0): "NV18"}
    plain = discovery.parse_topo_matrix(text.replace("\x1b[4m", "").replace("\x1b[0m", ""))
    assert plain == t


def test_recorded_h200_host_is_a_two_gpu_nvlink_domain():
    gpus = discovery.parse_query((FIX / "q_h200x2.txt").read_text())
    assert [g["name"] for g in gpus] == ["NVIDIA H200"] * 2
    assert [g["bus_id"] for g in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert gpus[0]["memory_mib"] == 143771
    # Hopper: fabric registered, but no multi-node cluster behind it.
    assert gpus[0]["fabric"]["state"] == "Completed" and gpus[0]["fabric"]["clique_id"] == "0"
    links = discovery.parse_topo_matrix((FIX / "topo-m_h200x2.txt").read_text())["links"]
    rep = discovery.build_report({"source": "nvidia-smi", "gpus": gpus, "links": links}, "gpu-host")
    assert (rep["domain"], rep["domain_kind"], rep["nvlink_islands"]) == ("node-gpu-host", "single-node NVLink", [[0, 1]])
    c = discovery.cluster_from_discovery(rep)
    assert c.largest_domain.num_gpus == 2 and c.nodes[0].gpu_model == "H200"


def test_topo_pcie_box_with_bridged_pairs_splits_islands():
    t = discovery.parse_topo_matrix((FIX / "topo-m_pcie-nvbridge-x4.txt").read_text())
    assert discovery.nvlink_islands(4, t["links"]) == [[0, 1], [2, 3]]
    rep = discovery.build_report({"source": "t", "gpus": [{"name": "L40S"}] * 4, "links": t["links"]}, "box")
    assert rep["domain_kind"] == "pcie" and any("not all NVLink peers" in w for w in rep["warnings"])
    assert discovery.cluster_from_discovery(rep).nodes[0].nvlink is False


def test_topo_garbage_is_a_clear_error():
    with pytest.raises(ValueError, match="no header row with a 'GPU0' column"):
        discovery.parse_topo_matrix("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_query_gb200_tray_fabric_names_the_rack_domain():
    gpus = discovery.parse_query((FIX / "q_gb200-nvl72-tray.txt").read_text())
    assert len(gpus) == 4
    assert gpus[0]["name"] == "NVIDIA GB200" and gpus[0]["uuid"].startswith("GPU-5c8e1f3a")
    assert gpus[2]["bus_id"] == "00000018:01:00.0" and gpus[3]["minor"] == 3
    assert gpus[1]["memory_mib"] == 189471
    fab = gpus[0]["fabric"]
    assert fab == {
        "state": "Completed",
        "status": "Success",
        "clique_id": "32766",
        "cluster_uuid": "9b6f1d24-7c3e-4a85-b0d2-51e8f4a7c639",
    }
    rep = discovery.build_report({"source": "nvidia-smi", "gpus": gpus, "links": {}}, "tray07")
    assert rep["domain"] == "nvl-9b6f1d24-7c3e-4a85-b0d2-51e8f4a7c639-32766"
    assert rep["domain_kind"] == "multi-node NVLink"
    labels = discovery.node_labels(rep)
    assert labels[DOMAIN_LABEL] == rep["domain"] and labels["wideep.io/gpu-model"] == "GB200"


def test_fabric_without_cluster_uuid_means_node_local_domain():
    assert discovery.fabric_domain({"state": None, "cluster_uuid": None, "clique_id": None}) is None
    zero = {"state": "Completed", "cluster_uuid": "00000000-0000-0000-0000-000000000000", "clique_id": "0"}
    assert discovery.fabric_domain(zero) is None
    pending = {"state": "In Progress", "cluster_uuid": "9b6f1d24-7c3e-4a85-b0d2-51e8f4a7c639", "clique_id": "1"}
    assert discovery.fabric_domain(pending) is None
    gpus = [{"name": "NVIDIA H200", "fabric": zero}] * 8
    t = discovery.parse_topo_matrix((FIX / "topo-m_hgx-h200x8.txt").read_text())
    rep = discovery.build_report({"source": "nvidia-smi", "gpus": gpus, "links": t["links"]}, "hgx-17")
    assert (rep["domain"], rep["domain_kind"]) == ("node-hgx-17", "single-node NVLink")
    c = discovery.cluster_from_discovery(rep)
    assert c.nodes[0].gpu_model == "H200" and c.largest_domain.num_gpus == 8


# --- probing without a GPU -----------------------------------------------------


def test_discover_without_gpu_stack_says_not_found(monkeypatch):
    monkeypatch.setattr(discovery, "_probe_nvml", lambda: None)
    monkeypatch.setattr(discovery.shutil, "which", lambda name: None)
    rep = discovery.discover_local()
    assert rep["status"] == discovery.NOT_FOUND and rep["num_gpus"] == 0
    with pytest.raises(ValueError, match="not found"):
        discovery.cluster_from_discovery(rep)
    assert discovery.node_labels(rep) == {ROLE_LABEL: "cpu"}


def test_failing_nvidia_smi_is_not_found(monkeypatch):
    def broken(cmd, **kw):
        raise OSError("driver/library version mismatch")

    monkeypatch.setattr(discovery, "_probe_nvml", lambda: None)
    monkeypatch.setattr(discovery.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(discovery.subprocess, "run", broken)
    assert discovery.discover_local()["status"] == discovery.NOT_FOUND


def test_discover_command_needs_only_the_standard_library(tmp_path):
    """`python -m placement.discover` must run where Ray, pydantic and PyYAML are absent."""
    script = (
        "import sys, runpy\n"
        "for blocked in ('ray', 'pydantic', 'yaml'):\n"
        "    sys.modules[blocked] = None\n"
        f"sys.argv = ['discover', '--query', {str(FIX / 'q_gb200-nvl72-tray.txt')!r}, "
        f"'--labels-file', {str(tmp_path / 'labels.yaml')!r}]\n"
        "runpy.run_module('placement.discover', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    summary, _, blob = out.stdout.partition("--- json ---")
    assert "4 x NVIDIA GB200" in summary and "multi-node NVLink" in summary
    report = json.loads(blob)
    assert report["domain"].startswith("nvl-9b6f1d24")
    labels = (tmp_path / "labels.yaml").read_text()
    assert f'"{DOMAIN_LABEL}": "{report["domain"]}"' in labels


def test_discover_command_on_a_host_without_gpus(tmp_path):
    script = (
        "import sys, runpy, shutil\n"
        "sys.modules['pynvml'] = None\n"
        "shutil.which = lambda name: None\n"
        "sys.argv = ['discover', '--json']\n"
        "runpy.run_module('placement.discover', run_name='__main__')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "not found"


# --- NVML path, through a stand-in for the nvidia-ml-py module ----------------


def _fake_pynvml(cluster_uuid: bytes, clique: int, nvlink_pairs: set):
    import ctypes
    import types

    class FabricV2(ctypes.Structure):
        _fields_ = [
            ("version", ctypes.c_uint),
            ("clusterUuid", ctypes.c_ubyte * 16),
            ("status", ctypes.c_uint),
            ("cliqueId", ctypes.c_uint),
            ("state", ctypes.c_uint),
            ("healthMask", ctypes.c_uint),
        ]

    def fabric_v(handle, ref):
        info = ref._obj
        assert info.version == 0x2000024  # the caller must set the struct version
        ctypes.memmove(info.clusterUuid, cluster_uuid, 16)
        info.status, info.cliqueId, info.state = 0, clique, 3

    m = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: "NVIDIA GB300",
        nvmlDeviceGetUUID=lambda h: f"GPU-{h:08d}-0000-0000-0000-000000000000",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=288 * 1024**3),
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=f"0000000{h}:01:00.0".encode()),
        nvmlDeviceGetP2PStatus=lambda a, b, idx: 0 if (min(a, b), max(a, b)) in nvlink_pairs else 1,
        c_nvmlGpuFabricInfo_v2_t=FabricV2,
        nvmlGpuFabricInfo_v2=0x2000024,
        nvmlDeviceGetGpuFabricInfoV=fabric_v,
        NVML_GPU_FABRIC_STATE_COMPLETED=3,
        NVML_P2P_CAPS_INDEX_NVLINK=2,
        NVML_P2P_STATUS_OK=0,
    )
    return m


def test_nvml_probe_reads_fabric_and_nvlink(monkeypatch):
    uuid = bytes.fromhex("9b6f1d247c3e4a85b0d251e8f4a7c639")
    all_pairs = {(i, j) for i in range(4) for j in range(i + 1, 4)}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(uuid, 7, all_pairs))
    rep = discovery.discover_local()
    assert rep["source"] == "nvml" and rep["num_gpus"] == 4
    assert rep["gpus"][1]["memory_mib"] == 288 * 1024 and rep["gpus"][2]["bus_id"] == "00000002:01:00.0"
    assert rep["domain"] == "nvl-9b6f1d24-7c3e-4a85-b0d2-51e8f4a7c639-7"
    assert rep["nvlink_islands"] == [[0, 1, 2, 3]]


def test_nvml_zero_uuid_falls_back_to_host_domain(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(bytes(16), 0, {(0, 1)}))
    monkeypatch.setattr(discovery.socket, "gethostname", lambda: "box7")
    rep = discovery.discover_local()
    assert rep["domain"] == "node-box7" and rep["domain_kind"] == "pcie"
    assert rep["nvlink_islands"] == [[0, 1], [2], [3]]
