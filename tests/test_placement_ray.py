"""Placement groups on a real local Ray cluster with fake GPUs on labelled nodes.

One cluster for the whole module (starting nodes is the slow part):
  head     CPU only, role=cpu
  rack-a   2 nodes x 4 GPUs, one NVLink domain (a small stand-in for an NVL72 rack)
  hgx-b    1 node  x 4 GPUs, its own domain (an HGX board)
Rank actors take num_cpus=0 so they only compete for the fake GPUs.
"""

import os
import shutil
import tempfile

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from placement import ray_groups  # noqa: E402
from placement.plan import CpuActorSpec, GroupSpec, Layout, PlacementError, make_plan  # noqa: E402
from placement.topology import DOMAIN_LABEL, ROLE_LABEL, cluster_from_description  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    tmp = tempfile.mkdtemp(prefix="wideep-ray-")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 0, "labels": {ROLE_LABEL: "cpu"}},
    )
    try:
        for _ in range(2):
            c.add_node(num_cpus=0, num_gpus=4, labels={ROLE_LABEL: "gpu", DOMAIN_LABEL: "rack-a"})
        c.add_node(num_cpus=0, num_gpus=4, labels={ROLE_LABEL: "gpu", DOMAIN_LABEL: "hgx-b"})
        ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


@ray.remote(num_cpus=0)
class Rank:
    def where(self):
        from placement.ray_groups import where_am_i

        return where_am_i()


def _spawn(placed, plan):
    actors = [Rank.options(**ray_groups.rank_options(placed, r, plan.rank_cpus)).remote() for r in range(len(placed.plan.slots))]
    return actors, ray.get([a.where.remote() for a in actors], timeout=120)


def test_live_cluster_is_modelled_from_labels(cluster):
    layout = Layout([GroupSpec("decode-0", "decode", 8)])
    plan = ray_groups.live_plan(layout)
    doms = {d.id: (d.num_gpus, len(d.nodes)) for d in plan.cluster.domains}
    assert doms == {"rack-a": (8, 2), "hgx-b": (4, 1)}
    assert plan.group("decode-0").domain == "rack-a"  # the only domain with 8 GPUs
    assert not plan.warnings


def test_decode_in_multi_node_domain_and_prefill_packs(cluster):
    layout = Layout(
        [
            GroupSpec("decode-0", "decode", 8),
            GroupSpec("prefill-0", "prefill", 2, span="node"),
            GroupSpec("prefill-1", "prefill", 2, span="node"),
        ],
        [CpuActorSpec("ingress")],
    )
    plan = ray_groups.live_plan(layout)
    placed = ray_groups.create_groups(plan)
    actors = []
    try:
        ray_groups.wait_ready(placed, timeout_s=60)
        for name in ("decode-0", "prefill-0", "prefill-1"):
            group_actors, reports = _spawn(placed[name], plan)
            actors += group_actors
            # Each rank on its planned node, domain and GPU, seeing only that GPU.
            assert ray_groups.check_ranks(plan, placed[name].plan, reports, strict_gpu=True) == []
            if name == "decode-0":
                assert {r["labels"][DOMAIN_LABEL] for r in reports} == {"rack-a"}
                # Node-major: ranks 0-3 on one node, 4-7 on the other.
                assert len({r["node_id"] for r in reports[:4]}) == 1
                assert len({r["node_id"] for r in reports[4:]}) == 1
                assert reports[0]["node_id"] != reports[4]["node_id"]
            else:
                assert len({r["node_id"] for r in reports}) == 1  # a DEP2 stays on one node
                assert {r["labels"][DOMAIN_LABEL] for r in reports} == {"hgx-b"}
        (ingress,) = plan.cpu_actors
        head = ray.get(Rank.options(**ingress.ray_options).remote().where.remote(), timeout=60)
        assert head["labels"][ROLE_LABEL] == "cpu" and head["gpu_ids"] == []
    finally:
        for a in actors:
            ray.kill(a)
        ray_groups.remove_groups(placed)


def test_group_bigger_than_any_domain_is_refused_before_ray(cluster):
    layout = Layout([GroupSpec("decode-0", "decode", 12)])
    with pytest.raises(PlacementError, match="largest NVLink domain .* has 8 GPUs"):
        ray_groups.live_plan(layout)


def test_plan_for_a_domain_the_cluster_lacks_times_out_clearly(cluster):
    # A plan made for a described cluster the running one does not match:
    # Ray keeps the group pending; wait_ready must say which group and why.
    described = cluster_from_description({"nodes": [{"name": "t", "count": 2, "gpus": 4, "domain": "rack-z"}]})
    plan = make_plan(described, Layout([GroupSpec("decode-0", "decode", 8)]))
    placed = ray_groups.create_groups(plan)
    try:
        with pytest.raises(ray_groups.PlacementTimeout) as e:
            ray_groups.wait_ready(placed, timeout_s=3)
        msg = str(e.value)
        assert "decode group 'decode-0'" in msg and f"{DOMAIN_LABEL}=rack-z" in msg and "not ready after 3s" in msg
    finally:
        ray_groups.remove_groups(placed)


def test_domain_selector_alone_keeps_group_inside_the_domain(cluster):
    # Without node pins Ray picks the nodes, but only inside the labelled domain.
    plan = ray_groups.live_plan(Layout([GroupSpec("decode-0", "decode", 4)]))
    assert plan.group("decode-0").domain == "hgx-b"  # best fit: the 4-GPU domain
    placed = ray_groups.create_groups(plan, pin_nodes=False)
    actors = []
    try:
        assert "ray.io/node-id" not in placed["decode-0"].request["bundle_label_selector"][0]
        ray_groups.wait_ready(placed, timeout_s=60)
        actors, reports = _spawn(placed["decode-0"], plan)
        assert {r["labels"][DOMAIN_LABEL] for r in reports} == {"hgx-b"}
        assert sorted(r["gpu_ids"][0] for r in reports) == ["0", "1", "2", "3"]
    finally:
        for a in actors:
            ray.kill(a)
        ray_groups.remove_groups(placed)


def test_group_rank_options_reserves_only_the_named_group(cluster):
    """What a DecodeGroup replica does on GPUs: plan everything, reserve its own group only."""
    from ray.util.placement_group import placement_group_table

    layout = Layout([GroupSpec("decode-0", "decode", 4), GroupSpec("prefill-0", "prefill", 2, span="node")])
    before = {pg_id for pg_id, t in placement_group_table().items() if t["state"] == "CREATED"}
    options = ray_groups.group_rank_options(layout, "decode-0", timeout_s=60)
    created = [t for pg_id, t in placement_group_table().items() if t["state"] == "CREATED" and pg_id not in before]
    actors = [Rank.options(**o).remote() for o in options]
    try:
        reports = ray.get([a.where.remote() for a in actors], timeout=120)
        assert len(options) == 4 and len(created) == 1 and len(created[0]["bundles"]) == 4
        assert len({r["labels"][DOMAIN_LABEL] for r in reports}) == 1
        assert len({r["cuda_visible_devices"] for r in reports}) == 4  # one GPU each, all different
    finally:
        for a in actors:
            ray.kill(a)
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(options[0]["scheduling_strategy"].placement_group)
    with pytest.raises(PlacementError):
        ray_groups.group_rank_options(Layout([GroupSpec("decode-0", "decode", 12)]), "decode-0")


def test_unlabelled_gpu_node_is_pinned_by_node_id_not_by_a_domain_label():
    """A GPU node without a domain label is its own domain; its placement group must not ask
    for a label the node does not carry (it would never be scheduled)."""
    from placement.plan import pg_request
    from placement.topology import cluster_from_ray_nodes

    nodes = [{"NodeID": "ab" * 28, "Alive": True, "Resources": {"GPU": 2.0, "CPU": 8.0}, "Labels": {}}]
    plan = make_plan(cluster_from_ray_nodes(nodes), Layout([GroupSpec("decode-0", "decode", 2)]))
    req = pg_request(plan, plan.group("decode-0"))
    for sel in req["bundle_label_selector"]:
        assert DOMAIN_LABEL not in sel and sel["ray.io/node-id"] == "ab" * 28
