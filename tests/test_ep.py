"""Expert parallelism over 2 CPU ranks (gloo) and live expert migration."""
import multiprocessing as mp
import socket

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.checkpoint import random_weights

import ep_worker


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(ckpt, scenario, timeout=120):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=ep_worker.run, args=(r, 2, port, str(ckpt), results, scenario)) for r in range(2)]
    for p in procs:
        p.start()
    outs = {}
    expected = 1 if scenario == "kill" else 2
    for _ in range(expected):
        out = results.get(timeout=timeout)
        outs[out["rank"]] = out
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return outs


@pytest.fixture(scope="module")
def migration_run(tiny_ckpt):
    return _run(tiny_ckpt, "migrate")


def test_ep_matches_single_process(migration_run, tiny_ckpt):
    single = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    for rank, out in migration_run.items():
        assert "error" not in out, out.get("error")
        expect = [o.output_token_ids for o in single.generate(ep_worker.prompts_for(rank), ep_worker.GREEDY)]
        assert out["before"] == expect


def test_ep_with_kernels_matches_single_process(tiny_ckpt, monkeypatch):
    """The same through the Triton kernels (interpreted), where each rank computes the shared
    expert for its own gathered rows in the routed experts' launches (fused_experts' shared_rows):
    a rank that took another's rows would change both ranks' tokens. The routing launch counts
    the load: each real token's k pairs once, none for padding."""
    outs = _run(tiny_ckpt, "kernels", timeout=300)
    check_load_counts(outs, tiny_ckpt)
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    single = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    for rank, out in outs.items():
        assert "error" not in out, out.get("error")
        assert out["shared_fused"]
        expect = single.generate(ep_worker.prompts_for(rank), ep_worker.GREEDY)
        assert [o.error for o in expect] == [None] * len(expect)
        assert out["before"] == [o.output_token_ids for o in expect]


@pytest.mark.parametrize("ckpt_fixture", ["tiny_ckpt", "tiny_v4_ckpt"])
def test_ranks_pick_the_same_graph_every_step(ckpt_fixture, request):
    """Graphs run eagerly on 2 CPU ranks (tests/ep_worker.py EagerGroupGraphs), prompts arriving
    on each rank at other times: at every step both ranks take the same graph (NCCL needs it on a
    GPU), decode graphs while all decode, chunk graphs where some rank computes a prompt (the
    other's decodes, or nothing, as its rows), never the eager path; and the tokens are those
    of the single-process engine. V4.1 options too (window rings, the indexer)."""
    ckpt = request.getfixturevalue(ckpt_fixture)
    outs = _run(ckpt, "graphs")
    single = LLMEngine.from_pretrained(ckpt, EngineConfig(block_size=4), progress=False)
    for rank, out in outs.items():
        assert "error" not in out, out.get("error")
        expect = [o.output_token_ids for o in single.generate(ep_worker.prompts_for(rank), ep_worker.GREEDY)]
        assert out["tokens"] == expect
        assert out["eager"] == []
    keys = outs[0]["keys"]
    assert keys == outs[1]["keys"]
    forms = {k[0] for k in keys}
    assert forms == {"decode", "chunk"}, forms


def test_ranks_capture_ahead_together_when_the_group_is_idle(tiny_v4_ckpt):
    """Both ranks' serving loops, idle after their requests, capture ahead (run eagerly here) the
    next table width of every shape the group served, the same graphs in the same order at the
    same step: a rank alone in a capture's collectives would hang or fail the group. Serving
    again gives the same tokens; the captures made with no request waiting are not counted."""
    outs = _run(tiny_v4_ckpt, "capture_ahead", timeout=300)
    for out in outs.values():
        assert "error" not in out, out.get("error")
        assert out["dead"] is None and out["again"] == out["tokens"]
    assert outs[0]["prepared"] == outs[1]["prepared"] and outs[0]["widest"] == outs[1]["widest"]
    # one capture a (form, rows) served: the width past the widest it reached, sparse past the
    # indexer's dense contexts (tiny-v4 keeps 16 keys, window 8)
    expect = [[form, rows, 20, True] for form, rows, width, sparse in outs[0]["widest"] if width == 16]
    assert expect and sorted(outs[0]["prepared"]) == sorted(expect), (outs[0]["widest"], outs[0]["prepared"])
    assert all(out["stats"]["graph_captures_ahead"] == len(expect) for out in outs.values())


def test_ranks_warm_up_together_and_generate_until_the_group_is_idle(tiny_ckpt):
    """The start-up warm-up runs on expert-parallel ranks too, all at once: each rank's requests
    step with the group's, and the graphs of every batch size at the shared width are captured
    by both ranks in one order (run eagerly here, keys recorded), with no real row. Nothing is
    left behind. Then generate() with other work on each rank (or none) returns on both, with
    the single process's tokens."""
    outs = _run(tiny_ckpt, "warmup", timeout=300)
    single = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for rank, out in outs.items():
        assert "error" not in out, out.get("error")
        prompts = ep_worker.prompts_for(rank)
        warm = out["after_warmup"]
        assert warm["kv_blocks_used"] == 0 and warm["running"] == warm["waiting"] == 0
        assert warm["steps"] == 0 and warm["load"] == 0 and warm["group_wait_s"] == 0
        shared = ([["decode", rows, out["min_blocks"], False] for rows in out["sizes"]]
                  + [["chunk", rows, out["min_blocks"], False] for rows in out["chunk_sizes"]])
        assert out["warmup_keys"][-len(shared):] == shared
        mine = prompts if rank == 0 else prompts[:1]
        expect = single.generate(mine, ep_worker.GREEDY if rank == 0 else short)
        assert out["uneven"] == [o.output_token_ids for o in expect]
        assert out["solo"] == ([expect[0].output_token_ids] if rank == 0 else [])
        assert out["stats"]["kv_blocks_used"] == 0 and out["stats"]["running"] == 0
    assert outs[0]["warmup_keys"] == outs[1]["warmup_keys"]
    assert outs[0]["stats"]["steps"] == outs[1]["stats"]["steps"]  # rank 1 stepped with rank 0


@pytest.mark.parametrize("ckpt_fixture,scenario,exchange", [
    ("tiny_ckpt", "ahead", "GlooExchange"), ("tiny_v4_ckpt", "ahead", "GlooExchange"),
    ("tiny_ckpt", "ahead_shm", "ShmExchange"),
])
def test_ranks_run_decode_steps_ahead(ckpt_fixture, scenario, exchange, request):
    """Async scheduling in lockstep: each rank launches its next decode step before reading the
    tokens of the one before, agreeing on it over the host group. Rank 1's prompt arrives while
    rank 0's step ahead is being agreed, so that step replays a chunk graph with its input tokens
    written on the device. With graphs (run eagerly) and without: the single process's tokens,
    the same graph on both ranks at every step, and steps launched ahead on both. The agreement
    over gloo, and through shared memory (as the GPU ranks of one host agree)."""
    ckpt = request.getfixturevalue(ckpt_fixture)
    outs = _run(ckpt, scenario)
    single = LLMEngine.from_pretrained(ckpt, EngineConfig(block_size=4), progress=False)
    for rank, out in outs.items():
        assert "error" not in out, out.get("error")
        assert out["exchange"] == exchange
        for form in ("graphs", "eager"):
            expect = single.generate(out[form + "_prompts"], ep_worker.GREEDY)
            assert out[form] == [o.output_token_ids for o in expect], form
        assert out["graphs_ahead_steps"] > 5 and out["eager_ahead_steps"] > 5
        # counted for operators: steps ahead, and time spent waiting for the other rank
        assert out["stats"]["steps_ahead"] == out["graphs_ahead_steps"] + out["eager_ahead_steps"]
        assert out["stats"]["group_wait_s"] > 0
    assert outs[0]["keys"] == outs[1]["keys"]
    assert {k[0] for k in outs[0]["ahead_keys"]} == {"decode", "chunk"}, outs[0]["ahead_keys"]


def test_outputs_identical_after_rebalance_and_experts_moved(migration_run, tiny_ckpt):
    experts = {}
    for name, t in random_weights(ep_worker_cfg(tiny_ckpt)):
        if name.startswith("model.layers.1.mlp.experts.") and name.endswith(("gate_proj.weight", "up_proj.weight")):
            experts[name] = t
    for rank, out in migration_run.items():
        assert out["switched"] == 1
        assert out["after"] == out["before"]
        # slot 0 of rank r now holds the expert that rank 1-r held in its slot 0
        moved = 4 if rank == 0 else 0
        gate = experts[f"model.layers.1.mlp.experts.{moved}.gate_proj.weight"]
        up = experts[f"model.layers.1.mlp.experts.{moved}.up_proj.weight"]
        assert torch.equal(torch.tensor(out["slot0_after"]), torch.cat([gate, up]))
        assert out["slot0_after"] != out["slot0_before"]
        assert out["phys2log_after"][0] == [4, 5, 6, 7, 0, 1, 2, 3]


def test_load_counts_only_real_rows(migration_run, tiny_ckpt):
    """The ranks' rows are padded to one count a step (rank 0 has two prompts, rank 1 one, of
    other lengths), but the load statistics count each real token's k pairs exactly once, on
    the rank holding the expert, and none for padding."""
    check_load_counts(migration_run, tiny_ckpt)


def check_load_counts(outs, ckpt):
    cfg = ep_worker_cfg(ckpt)
    tokens = sum(len(p) + ep_worker.GREEDY.max_tokens - 1 for rank in (0, 1) for p in ep_worker.prompts_for(rank))
    per_layer = [a + b for a, b in zip(outs[0]["load_before"], outs[1]["load_before"])]
    assert per_layer == [tokens * cfg.num_experts_per_tok] * len(per_layer)
    assert all(min(out["load_before"]) > 0 for out in outs.values())  # both ranks computed


def test_idle_rank_steps_with_the_busy_one(migration_run):
    """While only rank 0 has a request, rank 1 runs idle forwards in lockstep (its MoE layers'
    collectives), and rank 0's tokens are those it decoded beside rank 1's requests."""
    busy, idle = migration_run[0], migration_run[1]
    assert busy["solo"] == busy["before"][:1] and idle["solo"] == []
    assert idle["solo_steps"] >= ep_worker.GREEDY.max_tokens - 1
    assert idle["solo_steps"] == busy["solo_steps"]


def test_decode_keeps_stepping_while_staging(migration_run):
    for out in migration_run.values():
        assert out["staged"]["staged"] and out["staged"]["bytes"] > 0
        assert out["steps_during_staging"] >= 5  # staging took >= 1 s and decode went on meanwhile


def test_invalid_plans_are_refused(migration_run):
    for out in migration_run.values():
        short, empty = out["refused"]
        assert "plan shape" in short
        assert "have no slot" in empty


def test_fp8_experts_migrate_with_their_scales(tiny_ckpt):
    """Block-FP8 experts (EngineConfig.expert_dtype): every expert moves to the other rank, its
    scales with it, and the outputs stay the single-process FP8 engine's."""
    outs = _run(tiny_ckpt, "migrate_fp8")
    single = LLMEngine.from_pretrained(tiny_ckpt, ep_worker.engine_config(fp8=True), progress=False)
    for rank, out in outs.items():
        assert "error" not in out, out.get("error")
        expect = [o.output_token_ids for o in single.generate(ep_worker.prompts_for(rank), ep_worker.GREEDY)]
        assert out["before"] == expect
        assert out["switched"] == 1 and out["after"] == out["before"]
        other = outs[1 - rank]
        assert out["slot0_scale_before"] is not None
        assert out["slot0_after"] == other["slot0_before"] and out["slot0_scale_after"] == other["slot0_scale_before"]
        assert out["slot0_scale_after"] != out["slot0_scale_before"]


def test_rank_killed_mid_migration_keeps_old_placement(tiny_ckpt):
    outs = _run(tiny_ckpt, "kill")
    survivor = outs[0]
    assert "error" not in survivor, survivor.get("error")
    assert not survivor["staged"]["staged"]
    assert survivor["phys2log_after"][0] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert survivor["slot0_after"] == survivor["slot0_before"]
    assert survivor["after_kill"].startswith("EngineDeadError"), survivor["after_kill"]


def ep_worker_cfg(ckpt):
    from engine.config import ModelConfig
    return ModelConfig.from_file(ckpt)
