"""Graphs captured ahead in idle time (DecodeGraphs.capture_ahead, LLMEngine.housekeeping): the
next table width of each batch size serving replayed, so that serving does not stall on it."""
import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


def _graphs(max_blocks=64, dense_up_to=24, ep=None):
    """DecodeGraphs' bookkeeping alone, over a runner whose steps attend densely up to
    dense_up_to tokens; run and run_chunk record the shapes asked for instead of capturing."""
    g = DecodeGraphs.__new__(DecodeGraphs)
    runner = SimpleNamespace(cfg=SimpleNamespace(block_size=4), ep=ep,
                             needs_sparse=lambda longest: longest > dense_up_to)
    g.runner, g.min_blocks, g.max_blocks = runner, 16, max_blocks
    g.graphs, g.failed, g.widest, g.asked = {}, set(), {}, []
    g.captures_serving, g.capture_serving_s, g.captures_ahead, g._preparing = 0, 0.0, 0, False

    def run(form):
        def capture(batch, rows=None, shape=None):
            assert g._preparing and len(batch) == 0
            key = (form, *shape)
            g._served(*key)  # what a step of capture_ahead replays is not serving
            g.asked.append(key)
            g.graphs[key] = None
        return capture
    g.run, g.run_chunk = run("decode"), run("chunk")
    return g


def test_the_next_width_of_each_batch_size_served():
    g = _graphs()
    assert g.ahead_shapes() == [] and not g.capture_ahead()
    g._served("decode", 8, 16, False)
    g._served("decode", 8, 20, True)
    g._served("decode", 8, 16, False)  # narrower again: the widest stays
    g._served("chunk", 64, 16, False)
    g._served("decode", 1, 40, True)
    # decode 8 reached 20 blocks: next 24; chunk 64 at 16 blocks (64 tokens, dense) grows into
    # 17-20 blocks, whose contexts (past 24 tokens) need the indexer.
    assert g.ahead_shapes() == [("chunk", 64, 20, True), ("decode", 1, 48, True), ("decode", 8, 24, True)]
    assert g.capture_ahead() and g.asked == [("chunk", 64, 20, True)]
    while g.capture_ahead():
        pass
    assert g.asked == [("chunk", 64, 20, True), ("decode", 1, 48, True), ("decode", 8, 24, True)]
    assert g.captures_ahead == 3 and g.ahead_shapes() == []
    # only one width past what serving reached: the widths do not walk up while idle
    assert g.widest == {("decode", 8): (20, True), ("chunk", 64): (16, False), ("decode", 1): (40, True)}
    # serving reaching 24 asks for 28; a shape whose capture failed is not tried again
    g._served("decode", 8, 24, True)
    assert g.ahead_shapes() == [("decode", 8, 28, True)]
    g.failed.add(("decode", 8, 28, True))
    assert g.ahead_shapes() == []


def test_nothing_past_the_widest_table():
    g = _graphs(max_blocks=40)
    g._served("decode", 4, 40, True)
    assert g.ahead_shapes() == []  # 48 blocks would be past max_model_len
    g._served("decode", 2, 32, True)
    assert g.ahead_shapes() == [("decode", 2, 40, True)]


def test_a_lockstep_rank_pads_its_rows_to_the_groups_shape():
    """As at start (capture_short), a rank of an expert-parallel group captures with no real row,
    its MoE layers told the group's padded rows first (tests/test_ep.py runs two ranks)."""
    pads = []
    g = _graphs(ep=SimpleNamespace(pad_only=lambda rows: pads.append(rows)))
    g._served("chunk", 32, 16, True)
    assert g.capture_ahead() and pads == [32] and g.asked == [("chunk", 32, 20, True)]


def test_forget_serving_drops_the_warm_up():
    g = _graphs()
    g._served("decode", 16, 16, False)
    g.captures_serving, g.capture_serving_s, g.captures_ahead = 3, 0.1, 1
    g.forget_serving()
    assert (g.widest, g.captures_serving, g.capture_serving_s, g.captures_ahead) == ({}, 0, 0.0, 0)


class FakeGraphs:
    """What the engine asks of its graphs when idle; covers nothing, so steps run eagerly."""

    def __init__(self, shapes: int):
        self.pending, self.captured = shapes, []
        self.captures_serving, self.capture_serving_s, self.captures_ahead = 0, 0.0, 0

    def covers(self, batch_size):
        return False

    def covers_chunk(self, rows):
        return False

    def ahead_shapes(self):
        return [("decode", 1, 20, True)] * self.pending

    def capture_ahead(self):
        if not self.pending:
            return False
        self.pending -= 1
        self.captured.append(time.monotonic())
        return True


def _engine(ckpt, shapes, **cfg):
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(block_size=4, **cfg), progress=False)
    engine.runner.graphs = FakeGraphs(shapes)
    return engine


def test_housekeeping_captures_once_idle_one_at_a_time(tiny_ckpt):
    engine = _engine(tiny_ckpt, 2, cuda_graph_ahead_idle_s=1.0)
    engine.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    due = engine.housekeeping()
    assert 0 < due <= 1.0 and engine.runner.graphs.captured == []  # not idle long enough yet
    time.sleep(due)
    assert engine.housekeeping() == 0.0 and len(engine.runner.graphs.captured) == 1
    assert engine.housekeeping() == 0.0 and engine.housekeeping() is None
    assert len(engine.runner.graphs.captured) == 2
    stats = engine.stats()
    assert (stats["graph_captures"], stats["graph_captures_ahead"]) == (0, 0)  # the fake's own counts
    # a step with work restarts the wait
    engine.runner.graphs.pending = 1
    engine.generate(["hello"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert engine.housekeeping() > 0 and engine.runner.graphs.pending == 1


def test_housekeeping_captures_nothing_when_turned_off(tiny_ckpt):
    engine = _engine(tiny_ckpt, 2, cuda_graph_ahead_idle_s=None)
    assert engine.housekeeping() is None and engine.runner.graphs.pending == 2
    engine.runner.graphs = None  # no CUDA graphs (CPU): nothing to do either
    assert engine.housekeeping() is None and "graph_captures" not in engine.stats()
    with pytest.raises(ValidationError, match="cuda_graph_ahead_idle_s"):
        EngineConfig(cuda_graph_ahead_idle_s=-1)


def test_the_engine_loop_captures_back_to_back_and_still_serves(tiny_ckpt):
    """Once idle, the loop captures without its half-second idle sleep between two captures; a
    request that comes meanwhile is served."""
    engine = AsyncLLMEngine(_engine(tiny_ckpt, 6, cuda_graph_ahead_idle_s=0.05))
    fake = engine.engine.runner.graphs
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run(request_id):
        tokens = []
        async for out in engine.generate(request_id, "hello", params):
            tokens += out.new_token_ids
        return tokens

    try:
        first = asyncio.run(asyncio.wait_for(run("a"), 60))
        idle = time.monotonic()
        deadline = idle + 30
        while fake.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fake.pending == 0
        # six captures at the loop's idle sleep (0.5 s) apart would take 2.5 s
        assert fake.captured[-1] - fake.captured[0] < 1.5, fake.captured
        fake.pending = 1000  # captures that never end: requests still get the lock between them
        assert asyncio.run(asyncio.wait_for(run("b"), 60)) == first
    finally:
        engine.shutdown()
    assert engine.dead is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_next_turn_meets_no_decode_capture_after_idle(tiny_v4_ckpt):
    """A conversation's first turn decodes its table from 16 to 20 blocks; idle, the engine
    captures the 24-block graphs; the next turn, decoding from 20 into 24 blocks, meets no decode
    capture, and its tokens and logits are those of the path without graphs."""
    kw = dict(block_size=4, device="cuda", max_num_seqs=8, warmup=False, cuda_graph_min_tokens=0,
              cuda_graph_ahead_idle_s=0.0)
    prompt = torch.randint(4, 500, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    first = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)   # 40 -> 70 tokens
    second = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)  # 74 -> 88 tokens

    def conversation(engine, between=lambda: None):
        logits, sample = [], engine.runner.sample
        engine.runner.sample = lambda seqs, lg: logits.append(lg.clone()) or sample(seqs, lg)
        reply = engine.generate([prompt], first)[0].output_token_ids
        between()
        logits.clear()
        turn = prompt + reply + [7, 8, 9, 10]
        return engine.generate([turn], second)[0].output_token_ids, logits

    plain = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(cuda_graphs=False, **kw), progress=False)
    plain_tokens, plain_logits = conversation(plain)
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(**kw), progress=False)
    g = engine.runner.graphs
    seen = {}

    def idle():
        assert g.widest[("decode", 1)] == (20, True)
        for _ in range(100):
            if engine.housekeeping() is None:
                break
        assert ("decode", 1, 24, True) in g.graphs and g.ahead_shapes() == []
        seen.update(graphs=set(g.graphs), stats=engine.stats())
    tokens, logits = conversation(engine, idle)
    assert tokens == plain_tokens
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = seen["stats"]
    assert [k for k in g.graphs if k not in seen["graphs"] and k[0] == "decode"] == []
    assert stats["graph_captures"] > 0 and stats["graph_captures_ahead"] >= 1 and stats["graph_capture_s"] > 0
    assert engine.stats()["graph_captures_ahead"] == stats["graph_captures_ahead"]
    # the warm-up's requests and captures are not serving's
    warm = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(**dict(kw, warmup=True)), progress=False)
    assert warm.runner.graphs.widest == {} and warm.stats()["graph_captures"] == 0
