"""Async scheduling: a decode step launched before the previous step's tokens are read back.

On GPU this is the default; here it is forced on (async_scheduling=True) so the bookkeeping
(positions, blocks, discarded rows of requests that stopped) is checked against the engine
stepping one forward at a time, which must give the very same outputs.
"""
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


def _engine(ckpt, ahead: bool | None, **cfg):
    cfg = dict(dict(block_size=4, num_blocks=128, max_num_seqs=8), **cfg)
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(async_scheduling=ahead, **cfg), progress=False)
    engine.ahead_steps = 0
    run_ahead = engine.runner.run_ahead

    def counted(batch, ids):
        engine.ahead_steps += 1
        return run_ahead(batch, ids)
    engine.runner.run_ahead = counted
    return engine


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _summary(outs):
    return [(o.output_token_ids, o.finish_reason, o.text) for o in outs]


def _mixed_params(stop_token: int, stop_text: str):
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),   # leaves the batch early
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, top_k=50, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, stop=[stop_text], ignore_eos=True),
    ]


@pytest.mark.parametrize("which", ["tiny", "tiny-v4"])
def test_running_ahead_gives_the_outputs_of_stepping_one_at_a_time(which, tiny_ckpt, tiny_v4_ckpt):
    ckpt = tiny_ckpt if which == "tiny" else tiny_v4_ckpt
    sync, ahead = _engine(ckpt, False), _engine(ckpt, True)
    prompts = _prompts([7, 30, 3, 18, 11])
    # A stop token and a stop string the greedy run of prompt 2 and 4 meet midway.
    probe = sync.generate([prompts[2], prompts[4]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stop_token = probe[0].output_token_ids[6]
    stop_text = sync.tokenizer.decode(probe[1].output_token_ids[5:7])
    assert stop_text
    params = _mixed_params(stop_token, stop_text)
    want = sync.generate(prompts, params)
    got = ahead.generate(prompts, params)
    assert _summary(got) == _summary(want)
    assert [o.finish_reason for o in got] == ["length", "length", "stop", "length", "stop"]
    # Every step after the one prefill ran ahead: the batch shrinking (by length, by a stop)
    # never sent the engine back to one step at a time.
    assert sync.ahead_steps == 0 and ahead.ahead_steps == ahead.num_steps - 1 == 11
    assert (sync.stats()["steps_ahead"], ahead.stats()["steps_ahead"]) == (0, 11)  # what operators see
    # A second turn on the same prompts hits the prefix cache the first turn published.
    again = ahead.generate(prompts, params)
    assert _summary(again) == _summary(want)
    assert ahead.scheduler.prefix_hit_tokens > 0
    for e in (sync, ahead):
        e.step()  # a step left running ahead of requests that had ended is collected
        assert e.scheduler.blocks.num_used_blocks == 0 and e._inflight is None


def test_a_request_cut_by_the_context_limit_and_a_full_pool(tiny_ckpt):
    # max_model_len ends one request by length before max_tokens; 12 blocks of 4 tokens for
    # three growing requests force preemptions, which a step run ahead must never need.
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = _prompts([10, 6, 5], seed=1)
    outs = {}
    for mode in (False, True):
        e = _engine(tiny_ckpt, mode, max_model_len=24, num_blocks=12)
        outs[mode] = _summary(e.generate(prompts, params))
        assert e.scheduler.blocks.num_used_blocks == 0
        if mode:
            assert e.ahead_steps > 0
            assert e.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]
    assert all(len(ids) == 24 - len(p) and why == "length" for (ids, why, _), p in zip(outs[True], prompts))


def test_abort_while_a_step_runs_ahead(tiny_ckpt):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts([9, 14], seed=2)
    want = _engine(tiny_ckpt, False).generate(prompts, params)
    e = _engine(tiny_ckpt, True)
    e.add_request("keep", prompts[0], params)
    e.add_request("drop", prompts[1], params)
    seen = {"keep": [], "drop": []}
    for _ in range(4):
        for out in e.step():
            seen[out.request_id] += out.new_token_ids
    assert e._inflight is not None and e.ahead_steps > 0
    aborted = e.abort_request("drop")
    assert aborted.finished and aborted.finish_reason == "abort"
    last = None
    while e.has_unfinished_requests():
        for out in e.step():
            assert out.request_id == "keep"
            seen["keep"] += out.new_token_ids
            last = out
    assert last.finish_reason == "length"
    assert seen["keep"] == want[0].output_token_ids
    assert seen["drop"] == want[1].output_token_ids[:4]
    e.step()
    assert e.scheduler.blocks.num_used_blocks == 0


def test_a_request_arriving_mid_decode_joins_the_next_step(tiny_ckpt):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = _prompts([8, 13], seed=3)
    want = _engine(tiny_ckpt, False).generate(prompts, params)
    e = _engine(tiny_ckpt, True)
    e.add_request("first", prompts[0], params)
    got = {"first": [], "second": []}
    for _ in range(3):
        for out in e.step():
            got[out.request_id] += out.new_token_ids
    e.add_request("second", prompts[1], params)
    # The step in flight finishes; no further step runs ahead while the new request waits,
    # and the next step admits it.
    assert e._inflight is not None
    calls = []
    while e.has_unfinished_requests():
        calls.append(e.step())
        for out in calls[-1]:
            got[out.request_id] += out.new_token_ids
        if len(calls) == 1:
            assert e._inflight is None
    assert [o.request_id for o in calls[0]] == ["first"]
    assert {o.request_id for o in calls[1]} == {"first", "second"}
    assert [got["first"], got["second"]] == [o.output_token_ids for o in want]


def test_cpu_default_steps_one_at_a_time(tiny_ckpt):
    e = _engine(tiny_ckpt, None)
    e.generate(_prompts([5]), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert e.ahead_steps == 0 and e._token_buffers is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graph_max_batch", [64, 2])
def test_running_ahead_on_cuda_graphs_and_eager_decode(tiny_v4_ckpt, graph_max_batch):
    """On the GPU, the default: the input tokens of a step run ahead are copied into a replayed
    graph's inputs (or, past the graphs' largest batch, an eager step's), and tokens come back
    through pinned memory; the outputs are those of stepping one at a time."""
    kw = dict(device="cuda", cuda_graph_max_batch=graph_max_batch, warmup=False)
    sync, ahead = _engine(tiny_v4_ckpt, False, **kw), _engine(tiny_v4_ckpt, None, **kw)
    prompts = _prompts([7, 30, 3, 18, 45])
    probe = sync.generate([prompts[2], prompts[4]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    params = _mixed_params(probe[0].output_token_ids[6], sync.tokenizer.decode(probe[1].output_token_ids[5:7]))
    want = sync.generate(prompts, params)
    got = ahead.generate(prompts, params)
    assert _summary(got) == _summary(want)
    assert ahead._token_buffers is not None and ahead.ahead_steps == ahead.num_steps - 1
    ahead.step()
    assert ahead.scheduler.blocks.num_used_blocks == 0 and ahead._inflight is None


def test_the_serving_loop_with_steps_run_ahead(tiny_ckpt):
    """AsyncLLMEngine's thread steps an engine that runs ahead: concurrent streams get the
    offline outputs, and a client that goes away mid-stream leaves no block behind."""
    import asyncio

    from engine.async_engine import AsyncLLMEngine
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = _prompts([6, 17, 3], seed=4)
    expect = [o.output_token_ids for o in _engine(tiny_ckpt, False).generate(prompts, params)]
    inner = _engine(tiny_ckpt, True)
    aengine = AsyncLLMEngine(inner)
    try:
        async def one(i, prompt):
            tokens = []
            async for out in aengine.generate(f"req-{i}", prompt, params):
                tokens += out.new_token_ids
            return tokens

        async def cancelled():
            seen = 0
            async for _ in aengine.generate("long", prompts[0], SamplingParams(max_tokens=10_000, ignore_eos=True)):
                seen += 1
                if seen == 4:
                    break
            return seen

        async def main():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), cancelled())
        *got, seen = asyncio.run(asyncio.wait_for(main(), 60))
        assert got == expect and seen == 4
        assert inner.ahead_steps > 0
        stats = aengine.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("field,value", [("async_scheduling", "sometimes"), ("cuda_graph_max_chunk", -1),
                                         ("cuda_graph_max_chunk", "many")])
def test_bad_options_fail_at_start_naming_the_field(field, value):
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match=field):
        EngineConfig(**{field: value})
