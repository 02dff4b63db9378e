"""Placement plans, the app config schema, the shipped configs and cluster.yaml (no Ray cluster)."""

import json
from pathlib import Path

import pytest
import yaml

from app.config import AppConfig, ConfigError, load_serve_config, parse_app_config
from placement import dryrun
from placement.plan import (
    CpuActorSpec,
    GroupSpec,
    Layout,
    PlacementError,
    make_plan,
    pg_request,
    serve_replica_options,
)
from placement.topology import DOMAIN_LABEL, RAY_NODE_ID_LABEL, ROLE_LABEL, cluster_from_description, cluster_from_ray_nodes

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

HGX_X4 = {"name": "hgx4", "nodes": [{"name": "head", "cpus": 8}, {"name": "hgx", "count": 4, "gpus": 8}]}
NVL72 = {"name": "rack", "nodes": [{"name": "head", "cpus": 8}, {"name": "tray", "count": 18, "gpus": 4, "domain": "r0"}]}


def _layout(decode, prefill=(), prefill_size=2):
    groups = [GroupSpec(f"decode-{i}", "decode", n) for i, n in enumerate(decode)]
    groups += [GroupSpec(f"prefill-{i}", "prefill", prefill_size, span="node") for i in range(len(prefill))]
    return Layout(groups, [CpuActorSpec("ingress"), CpuActorSpec("eplb-controller")])


# --- planning ------------------------------------------------------------------


def test_dep32_on_largest_domain_of_8_fails_clearly():
    with pytest.raises(PlacementError) as e:
        make_plan(cluster_from_description(HGX_X4), _layout([32]))
    msg = str(e.value)
    assert "DEP32" in msg and "needs 32 GPUs in one NVLink domain" in msg
    assert "largest NVLink domain" in msg and "has 8 GPUs" in msg


def test_dep32_fits_an_nvl72_rack_node_major():
    plan = make_plan(cluster_from_description(NVL72), _layout([32], prefill=range(8)))
    dec = plan.group("decode-0")
    assert dec.domain == "r0" and len(dec.nodes) == 8
    # Node-major: ranks 4k..4k+3 share a tray, so EP neighbours share the tray's links.
    for s in dec.slots:
        assert s.node == dec.nodes[s.rank // 4] and s.gpu == s.rank % 4
    pre_nodes = [plan.group(f"prefill-{i}").nodes for i in range(8)]
    assert all(len(n) == 1 for n in pre_nodes)  # each DEP2 on one tray
    assert len({n[0] for n in pre_nodes}) == 4  # packed two per tray, no stranded GPUs
    assert plan.gpus_used == 48
    used = {(s.node, s.gpu) for g in plan.groups for s in g.slots}
    assert len(used) == 48


def test_each_decode_group_gets_its_own_domain():
    plan = make_plan(cluster_from_description(HGX_X4), _layout([8, 8, 8]))
    assert sorted(plan.group(f"decode-{i}").domain for i in range(3)) == ["hgx-00", "hgx-01", "hgx-02"]


def test_domains_fit_but_already_taken_is_explained():
    with pytest.raises(PlacementError, match="left none large enough") as e:
        make_plan(cluster_from_description(HGX_X4), _layout([8, 8, 4, 6, 6]))
    # 32 GPUs for 32 ranks, but bigger groups go first: the two DEP6 leave
    # 2 GPUs in each of their domains, and a DEP4 cannot be split.
    assert "hgx-02: 2 free of 8 GPU(s) on 1 node(s); hgx-03: 2 free of 8" in str(e.value)


def test_total_gpu_shortage_is_explained():
    with pytest.raises(PlacementError, match="needs 40 GPUs .* has 32"):
        make_plan(cluster_from_description(HGX_X4), _layout([8], prefill=range(16)))


def test_prefill_larger_than_a_node_stays_in_one_domain():
    plan = make_plan(cluster_from_description(NVL72), _layout([], prefill=[0], prefill_size=8))
    g = plan.group("prefill-0")
    assert g.domain == "r0" and len(g.nodes) == 2


def test_best_fit_keeps_the_big_domain_whole():
    desc = {"nodes": [{"name": "small", "gpus": 4}, {"name": "tray", "count": 4, "gpus": 4, "domain": "big"}]}
    plan = make_plan(cluster_from_description(desc), _layout([4, 16]))
    assert plan.group("decode-1").domain == "big" and plan.group("decode-0").domain == "small"


def test_cpu_actors_go_to_cpu_nodes_with_a_label_selector():
    plan = make_plan(cluster_from_description(HGX_X4), _layout([8]))
    for a in plan.cpu_actors:
        assert a.node == "head"
        assert a.ray_options == {"num_cpus": 1.0, "num_gpus": 0, "label_selector": {ROLE_LABEL: "cpu"}}
    solo = cluster_from_description({"nodes": [{"name": "box", "gpus": 2, "cpus": 16}]})
    plan = make_plan(solo, _layout([1]))
    assert plan.cpu_actors[0].node == "box" and "label_selector" not in plan.cpu_actors[0].ray_options


def test_cpu_groups_take_no_gpus():
    layout = Layout([GroupSpec("decode-0", "decode", 2, device="cpu")])
    plan = make_plan(cluster_from_description({"nodes": [{"name": "laptop", "cpus": 4}]}), layout)
    req = pg_request(plan, plan.groups[0])
    assert req["bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}] and "bundle_label_selector" not in req


def test_pg_request_described_cluster_selects_domain_only():
    plan = make_plan(cluster_from_description(NVL72), _layout([32], prefill=[0]))
    dec = pg_request(plan, plan.group("decode-0"))
    assert dec["strategy"] == "PACK" and len(dec["bundles"]) == 32
    assert dec["bundle_label_selector"] == [{DOMAIN_LABEL: "r0"}] * 32
    pre = pg_request(plan, plan.group("prefill-0"))
    assert pre["strategy"] == "STRICT_PACK" and "bundle_label_selector" not in pre


def test_pg_request_live_cluster_pins_nodes():
    ray_nodes = [
        {"NodeID": f"{i:02d}" * 28, "Resources": {"GPU": 4.0}, "Labels": {DOMAIN_LABEL: "r0"}} for i in range(3)
    ]
    plan = make_plan(cluster_from_ray_nodes(ray_nodes), _layout([8]))
    req = pg_request(plan, plan.group("decode-0"))
    ids = [sel[RAY_NODE_ID_LABEL] for sel in req["bundle_label_selector"]]
    assert ids[:4] == [ids[0]] * 4 and ids[4:] == [ids[4]] * 4 and ids[0] != ids[4]
    assert all(sel[DOMAIN_LABEL] == "r0" for sel in req["bundle_label_selector"])
    unpinned = pg_request(plan, plan.group("decode-0"), pin_nodes=False)
    assert unpinned["bundle_label_selector"] == [{DOMAIN_LABEL: "r0"}] * 8


def test_serve_replica_options_for_autoscaled_prefill():
    plan = make_plan(cluster_from_description(NVL72), _layout([32], prefill=range(8)))
    opts = serve_replica_options(plan, "prefill")
    assert opts == {"placement_group_bundles": [{"GPU": 1.0}] * 2, "placement_group_strategy": "STRICT_PACK"}
    with pytest.raises(PlacementError, match="no 'router' group"):
        serve_replica_options(plan, "router")


def test_group_spec_rejects_nonsense():
    with pytest.raises(PlacementError, match="size must be >= 1"):
        GroupSpec("d", "decode", 0)
    with pytest.raises(PlacementError, match="span must be"):
        GroupSpec("d", "decode", 2, span="rack")


# --- app config schema ------------------------------------------------------------


def test_defaults_are_the_tiny_cpu_layout():
    cfg = AppConfig()
    assert cfg.model.preset == "tiny" and cfg.model.served_name == "tiny"
    assert cfg.prefill.replicas == 1 and cfg.decode.devices == "cpu"
    names = [g.name for g in cfg.layout().groups]
    assert names == ["decode-0", "prefill-0"]


def test_commented_out_section_means_its_defaults():
    """`routing:` with every key commented out is YAML null: the section's defaults, not an error."""
    cfg = parse_app_config(yaml.safe_load("routing:\n  # policy: least_loaded\neplb:\n  enabled: false\n"))
    assert cfg.routing == parse_app_config({}).routing and cfg.eplb.enabled is False
    with pytest.raises(ConfigError, match="routing"):
        parse_app_config({"routing": 3})


def test_agentx_bench_config_validates():
    from bench.agentx.__main__ import app_args
    for overrides in ([], ["{prefill: {replicas: 0}, kv_transport: {backend: none}, decode: {dp_size: 2}}",
                           "{routing: {policy: least_loaded}}"]):
        cfg = parse_app_config(app_args(str(CONFIGS / "agentx-h200x2.yaml"), overrides, None))
        assert cfg.decode.devices == "cuda"


def test_unknown_key_names_the_field_and_suggests():
    with pytest.raises(ConfigError) as e:
        parse_app_config({"prefill": {"replica": 2}})
    assert "args.prefill.replica: unknown field 'replica' (did you mean 'replicas'?)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_app_config({"prefill": {"autoscaling_config": {"max_replica": 4}}})
    assert "args.prefill.autoscaling_config.max_replica" in str(e.value) and "'max_replicas'" in str(e.value)
    with pytest.raises(ConfigError, match="args.decoder: unknown field 'decoder' .*'decode'"):
        parse_app_config({"decoder": {}})


@pytest.mark.parametrize(
    "args, needle",
    [
        ({"prefill": {"replicas": 2, "autoscaling_config": {"max_replicas": 4}}}, "either `replicas` or `autoscaling_config`"),
        ({"prefill": {"autoscaling_config": {"min_replicas": 5, "max_replicas": 4}}}, "min_replicas (5) > max_replicas (4)"),
        ({"decode": {"dp_size": 0}}, "args.decode.dp_size"),
        ({"decode": {"devices": "gpu"}}, "args.decode.devices"),
        ({"model": {"name": "x"}}, "set `path`"),
        ({"kv_transport": {"backend": "cuda_ipc"}}, "'cuda_ipc' needs prefill.devices and decode.devices"),
        ({"placement": {"cluster": {"nodes": [{"name": "a", "gpu": 2}]}}}, "unknown key(s) ['gpu']"),
    ],
)
def test_bad_configs_fail_with_the_reason(args, needle):
    with pytest.raises(ConfigError) as e:
        parse_app_config(args)
    assert needle in str(e.value)


def test_autoscaled_prefill_reserves_max_replicas():
    cfg = parse_app_config({"prefill": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}, "group_size": 2}})
    assert cfg.prefill.max_groups == 3
    assert cfg.prefill.autoscaling_config.to_serve() == {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 4.0,
    }
    assert [g.size for g in cfg.layout().groups if g.role == "prefill"] == [2, 2, 2]


def test_inline_cluster_description():
    cfg = parse_app_config({"placement": {"cluster": {"nodes": [{"name": "a", "gpus": 2}]}}})
    assert cfg.placement.described_cluster().num_gpus == 2
    assert parse_app_config({}).placement.described_cluster() is None


# --- shipped configs -------------------------------------------------------------------

LAYOUTS = {
    "h200x2.yaml": ("clusters/h200x2.yaml", {"decode": 1, "prefill": 1}, 2),
    "h200x8.yaml": ("clusters/h200x8.yaml", {"decode": 4, "prefill": 4}, 8),
    "gb300-nvl72.yaml": ("clusters/gb300-nvl72.yaml", {"decode": 32, "prefill": 16}, 48),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_shipped_config_validates_and_places(name):
    cluster_file, per_role, gpus = LAYOUTS[name]
    serve_cfg, cfg = load_serve_config(CONFIGS / name)
    assert serve_cfg["applications"][0]["import_path"] == "app.main:build_app"
    cluster = dryrun.load_cluster_file(CONFIGS / cluster_file)
    plan = make_plan(cluster, cfg.layout())
    for role, n in per_role.items():
        assert sum(len(g.slots) for g in plan.groups if g.spec.role == role) == n
    assert plan.gpus_used == gpus
    for g in plan.groups:
        if g.spec.role == "decode":
            assert g.domain is not None  # the whole decode group in one domain
        if g.spec.role == "prefill":
            assert len(g.nodes) == 1
    assert not plan.warnings


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside ray.serve's own models
def test_shipped_configs_are_valid_serve_configs():
    from ray.serve.schema import ServeDeploySchema

    for name in LAYOUTS:
        schema = ServeDeploySchema.model_validate(yaml.safe_load((CONFIGS / name).read_text()))
        assert schema.applications[0].name == "wideep"


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dry_run_prints_every_rank(name, capsys):
    cluster_file, per_role, _ = LAYOUTS[name]
    rc = dryrun.main(["--config", str(CONFIGS / name), "--cluster", str(CONFIGS / cluster_file)])
    out = capsys.readouterr().out
    assert rc == 0
    rank_rows = [ln for ln in out.splitlines() if ln.startswith(("decode-", "prefill-"))]
    assert len(rank_rows) == sum(per_role.values())
    assert "placement groups (bundle i = rank i):" in out


def test_dry_run_json(capsys):
    rc = dryrun.main(
        ["--config", str(CONFIGS / "h200x8.yaml"), "--cluster", str(CONFIGS / "clusters/h200x8.yaml"), "--json"]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 0 and data["gpus_used"] == 8
    assert {pg["name"] for pg in data["placement_groups"]} == {"decode-0", "prefill-0", "prefill-1"}


def test_dry_run_dep32_on_hgx_cluster_fails_with_reason(capsys):
    rc = dryrun.main(
        ["--config", str(CONFIGS / "gb300-nvl72.yaml"), "--cluster", str(CONFIGS / "clusters/hgx-h200x8-x4.yaml")]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert "DEP32" in err and "largest NVLink domain" in err and "has 8 GPUs" in err


def test_dry_run_bad_inputs_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "applications:\n- name: w\n  import_path: app.main:build_app\n  args: {decode: {dp_sise: 4}}\n"
    )
    assert dryrun.main(["--config", str(bad), "--cluster", str(CONFIGS / "clusters/h200x8.yaml")]) == 2
    assert "applications[0].args.decode.dp_sise: unknown field" in capsys.readouterr().err
    assert dryrun.main(["--config", str(CONFIGS / "h200x8.yaml"), "--cluster", str(tmp_path / "none.yaml")]) == 2
    assert "file not found" in capsys.readouterr().err


# --- cluster.yaml ------------------------------------------------------------------------


def test_cluster_yaml_matches_rays_launcher_schema():
    import jsonschema
    import ray

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    jsonschema.validate(config, json.loads(schema_path.read_text()))

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["labels"][ROLE_LABEL] == "cpu"
    gpu_types = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert len(gpu_types) >= 2
    for t in gpu_types:
        assert t["labels"][ROLE_LABEL] == "gpu" and t["labels"]["wideep.io/gpu-model"]
    # The per-node domain label comes from discovery at worker start.
    start = " ".join(config["worker_start_ray_commands"])
    assert "placement.discover --labels-file" in start and "--labels-file=" in start


def test_check_ranks_reports_misplaced_and_shared_gpus():
    from placement.ray_groups import check_ranks

    ray_nodes = [{"NodeID": f"{i:02d}" * 28, "Resources": {"GPU": 2.0}, "Labels": {DOMAIN_LABEL: "r0"}} for i in range(2)]
    plan = make_plan(cluster_from_ray_nodes(ray_nodes), Layout([GroupSpec("decode-0", "decode", 4)]))
    group = plan.group("decode-0")
    good = [
        {"node_id": plan.cluster.node(s.node).ray_node_id, "labels": {DOMAIN_LABEL: "r0"}, "gpu_ids": [str(s.gpu)], "cuda_visible_devices": str(s.gpu)}
        for s in group.slots
    ]
    assert check_ranks(plan, group, good, strict_gpu=True) == []
    bad = [dict(r) for r in good]
    bad[1] = {**bad[1], "labels": {DOMAIN_LABEL: "r9"}}
    bad[2] = {**bad[2], "node_id": good[0]["node_id"], "gpu_ids": ["0"], "cuda_visible_devices": "0"}
    bad[3] = {**bad[3], "cuda_visible_devices": "0,1"}
    problems = check_ranks(plan, group, bad, strict_gpu=True)
    assert any("rank 1: on domain 'r9', planned 'r0'" in p for p in problems)
    assert any("rank 2: on node" in p for p in problems)
    assert any("rank 2: shares GPU 0" in p for p in problems)
    assert any("rank 3: CUDA_VISIBLE_DEVICES='0,1'" in p for p in problems)


def test_dry_run_against_ray_without_a_cluster_says_so(monkeypatch, capsys):
    import ray

    def no_cluster(*a, **kw):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    assert dryrun.main(["--config", str(CONFIGS / "h200x2.yaml")]) == 2  # the config says cluster: ray
    assert "no running Ray cluster found" in capsys.readouterr().err
