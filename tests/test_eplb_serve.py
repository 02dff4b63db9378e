"""Wide-EP decode group with the EPLB controller, in the Serve application (2 CPU ranks, gloo)."""
import pytest
import ray
from ray import serve

from app.main import build_app


@pytest.fixture(scope="module", params=[None, True], ids=["one-step-at-a-time", "steps-ahead"])
def group(tiny_ckpt, tmp_path_factory, request):
    """The decode group; with async_scheduling on (the GPU default) each rank launches its next
    decode step before reading this one's tokens, agreeing with the other rank on the host."""
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        args = {"model": {"path": str(tiny_ckpt)},
                "engine": {"block_size": 4, "num_blocks": 128, "async_scheduling": request.param},
                "decode": {"dp_size": 2}, "kv_transport": {"backend": "none"},
                "eplb": {"enabled": True, "interval_s": 3600, "stage_timeout_s": 3}}
        serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
        handle = serve.get_deployment_handle("DecodeGroup", app_name="wideep")
        handle.async_scheduling = request.param
        yield handle
    finally:
        serve.shutdown()
        ray.shutdown()


def _generate(group, rid, prompt, session=None):
    stream = group.options(stream=True).generate.remote(
        {"request_id": rid, "prompt_token_ids": prompt,
         "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}, session_id=session)
    return [t for out in stream for t in out["new_token_ids"]]


PROMPT = list(range(20, 60))


def test_rebalance_by_hand_keeps_outputs(group):
    before = _generate(group, "a0", PROMPT)
    for i in range(4):  # some load for the statistics
        _generate(group, f"load{i}", list(range(5 + i, 40 + i)))
    report = group.rebalance.remote(force=True).result()
    assert report["action"] in ("switched", "kept"), report
    assert len(report["imbalance_before"]) == 3 and report["tokens"] > 0
    # Pin a placement that moves every expert to the other rank: all must travel.
    swapped = [[4, 5, 6, 7, 0, 1, 2, 3]] * 3
    moved = group.migrate_to.remote(swapped).result()
    assert moved["action"] == "switched", moved
    assert moved["bytes_moved"] > 0 and moved["migration_s"] < 30
    assert all(s["phys2log"] == swapped for s in group.ep_status.remote().result())
    assert _generate(group, "a1", PROMPT) == before


def test_migration_that_times_out_is_abandoned_everywhere(group):
    placement = group.ep_status.remote().result()[0]["phys2log"]
    other = [[(e + 1) % 8 for e in row] for row in placement]
    report = group.migrate_to.remote(other, stage_delay_s=10).result()  # staging slower than the 3 s limit
    assert report["action"] == "abandoned", report
    assert all(s["phys2log"] == placement for s in group.ep_status.remote().result())
    assert group.eplb_status.remote().result()["abandoned"] == 1
    assert len(_generate(group, "after", PROMPT)) == 12  # decode goes on with the old placement


def test_invalid_placements_are_refused(group):
    with pytest.raises(Exception, match="no slot|no replica|shape"):
        group.migrate_to.remote([[0] * 8] * 3).result()
    with pytest.raises(Exception, match="shape"):
        group.migrate_to.remote([[0, 1, 2, 3, 4, 5, 6, 7]]).result()


def test_ranks_step_ahead_when_asked(group):
    _generate(group, "ahead", PROMPT)
    stats = group.stats.remote().result()
    assert len(stats) == 2 and all(rank["group_wait_s"] >= 0 for rank in stats)
    # the rank that served decoded ahead; the idle one had nothing to run ahead
    assert (sum(rank["steps_ahead"] for rank in stats) > 0) == bool(group.async_scheduling), stats
