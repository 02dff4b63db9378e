"""Prefill/decode hand-off inside the engine: reserve on decode, hold on prefill, commit or fall back."""
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompt(n, seed=0):
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engines(ckpt, **cfg):
    """A prefill and a decode engine; the decode one counts the tokens it computes."""
    cfg = EngineConfig(block_size=4, **cfg)
    prefill = LLMEngine.from_pretrained(ckpt, cfg, progress=False)
    decode = LLMEngine.from_pretrained(ckpt, cfg, progress=False)
    decode.computed = []
    run = decode.runner.run

    def counting(batch):
        decode.computed.append(sum(batch.num_tokens))
        return run(batch)
    decode.runner.run = counting
    return prefill, decode


def _run(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def _copy_blocks(src, dst, src_blocks, dst_blocks):
    """What the KV transport does, by plain tensor copies (both engines in this process)."""
    bs = src.cfg.block_size
    pairs = [(src.runner.kv.global_kv, dst.runner.kv.global_kv),
             (src.runner.kv.index_keys, dst.runner.kv.index_keys)]
    for s, d in pairs:
        if s is None:
            continue
        for a, b in zip(src_blocks, dst_blocks):
            d[:, b * bs:(b + 1) * bs] = s[:, a * bs:(a + 1) * bs]


def _handoff(prefill, decode, rid, prompt, params):
    res = decode.reserve_remote(rid, prompt, params)
    assert res is not None
    prefill.add_request(rid, res["prompt_token_ids"], SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    first = _run(prefill)[rid].output_token_ids[0]
    src = prefill.held_blocks(rid)[res["cached_blocks"]:]
    _copy_blocks(prefill, decode, src, res["dst_blocks"])
    prefill.release_held(rid)
    decode.commit_remote(rid, first)
    return res


@pytest.mark.parametrize("ckpt, replay", [("tiny_ckpt", "bounded"), ("tiny_v4_ckpt", "exact")])
def test_pd_output_equals_decode_alone(ckpt, replay, request):
    path = request.getfixturevalue(ckpt)
    prefill, decode = _engines(path, replay_mode=replay)
    alone = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, replay_mode=replay), progress=False)
    prompt = _prompt(50, 3)
    res = _handoff(prefill, decode, "r1", prompt, GREEDY)
    assert res["cached_blocks"] == 0 and len(res["dst_blocks"]) == 13
    out = _run(decode)["r1"]
    assert out.output_token_ids == alone.generate([prompt], GREEDY)[0].output_token_ids
    for e in (prefill, decode):
        assert e.stats()["kv_blocks_used"] == 0 and e.stats()["held_kv"] == 0
    w = decode.model_cfg.sliding_window
    replayed = min(50, w * decode.model_cfg.num_hidden_layers) if w else 0
    assert decode.stats()["replayed_tokens"] == replayed
    # Decode computed no prompt token beyond the window replay: the rest came as KV.
    assert decode.computed == [replayed + 1] + [1] * 10


def test_second_turn_sends_only_uncached_blocks(tiny_ckpt):
    prefill, decode = _engines(tiny_ckpt)
    turn1 = _prompt(40, 1)
    _handoff(prefill, decode, "t1", turn1, GREEDY)
    first = _run(decode)["t1"]
    turn2 = turn1 + first.output_token_ids + _prompt(20, 2)
    res = _handoff(prefill, decode, "t2", turn2, GREEDY)
    assert res["cached_blocks"] == (len(turn1) + len(first.output_token_ids) - 1) // 4
    assert len(res["dst_blocks"]) == -(-len(turn2) // 4) - res["cached_blocks"]
    out = _run(decode)["t2"]
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    assert out.output_token_ids == alone.generate([turn2], GREEDY)[0].output_token_ids


def test_failed_transfer_falls_back_and_abort_frees_reservation(tiny_ckpt):
    prefill, decode = _engines(tiny_ckpt, remote_kv_grace_s=0)
    prompt = _prompt(30, 4)
    decode.reserve_remote("lost", prompt, GREEDY)
    assert decode.stats()["kv_blocks_used"] == 8 and decode.stats()["awaiting_kv"] == 1
    decode.fallback_local("lost")
    out = _run(decode)["lost"]
    assert out.output_token_ids == prefill.generate([prompt], GREEDY)[0].output_token_ids
    decode.reserve_remote("gone", prompt, GREEDY)
    decode.abort_request("gone")
    assert decode.commit_remote("gone", 5) is None  # a late transfer for an aborted request is ignored
    assert decode.stats()["kv_blocks_used"] == 0 and decode.stats()["awaiting_kv"] == 0
    # An aborted prefill does not hold its blocks.
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    prefill.abort_request("p")
    assert prefill.stats()["held_kv"] == 0 and prefill.stats()["kv_blocks_used"] == 0


def test_abandoned_reservation_is_quarantined_then_freed(tiny_ckpt):
    # a grace longer than the local run takes on a loaded machine
    _, decode = _engines(tiny_ckpt, remote_kv_grace_s=2.0)
    prompt = _prompt(30, 4)
    decode.reserve_remote("late", prompt, GREEDY)
    reserved = list(decode.scheduler.awaiting_kv["late"].block_table)
    decode.fallback_local("late")
    out = _run(decode)["late"]
    assert len(out.output_token_ids) == 12
    # The local prefill used other blocks: a write still in flight cannot corrupt it.
    assert decode.stats()["quarantined_blocks"] == 8
    assert all(decode.scheduler.blocks.ref_count[b] == 1 for b in reserved)
    decode.reserve_remote("gone", prompt, GREEDY)
    decode.abort_request("gone")
    assert decode.stats()["quarantined_blocks"] == 16
    time.sleep(2.05)
    decode.housekeeping()
    assert decode.stats()["quarantined_blocks"] == 0 and decode.stats()["kv_blocks_used"] == 0


def test_reservation_refused_when_pool_is_full_queues_locally(tiny_ckpt):
    decode = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=12, remote_kv_grace_s=0),
                                       progress=False)
    assert decode.reserve_remote("a", _prompt(40, 5), GREEDY) is not None   # 10 of 12 blocks
    assert decode.reserve_remote("b", _prompt(40, 6), GREEDY) is None       # queued locally instead
    decode.fallback_local("a")
    outs = _run(decode)
    assert set(outs) == {"a", "b"} and decode.stats()["kv_blocks_used"] == 0


def test_fp8_kv_moves_with_its_scales_over_nixl(tiny_v4_ckpt):
    """With an FP8 global KV the per-token scales are part of the pool: a hand-off through the
    NIXL transport (host memory) must carry them, or decode reads mis-scaled keys."""
    from engine.kv_transfer import KVTransport, transfer_tensors

    prefill, decode = _engines(tiny_v4_ckpt, kv_cache_dtype="fp8_e4m3", replay_mode="exact")
    alone = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, kv_cache_dtype="fp8_e4m3",
                                                                 replay_mode="exact"), progress=False)
    src_t = transfer_tensors(prefill.runner.kv)
    assert sum(t.dtype == torch.float32 and t.shape[-1] == 1 for t in src_t) == 2  # both sets of scales travel
    src = KVTransport("fp8-prefill", src_t, 4)
    dst = KVTransport("fp8-decode", transfer_tensors(decode.runner.kv), 4)
    try:
        peer = src.connect(dst.metadata())
        prompt = _prompt(50, 5)
        res = decode.reserve_remote("r", prompt, GREEDY)
        prefill.add_request("r", res["prompt_token_ids"], SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        first = _run(prefill)["r"].output_token_ids[0]
        blocks = prefill.held_blocks("r")[res["cached_blocks"]:]
        src.wait(src.write_blocks(peer, blocks, res["dst_blocks"], b"fp8"), 30)
        assert dst.wait_notification(b"fp8", 30)
        prefill.release_held("r")
        decode.commit_remote("r", first)
        out = _run(decode)["r"]
    finally:
        src.close()
        dst.close()
    assert out.output_token_ids == alone.generate([prompt], GREEDY)[0].output_token_ids


class _StepNotDone:
    """The event of a step still running on the device: query() is False; counts the waits."""
    def __init__(self):
        self.waits = 0

    def query(self):
        return False

    def synchronize(self):
        self.waits += 1


@pytest.mark.parametrize("room", ["enough", "short"])
def test_a_reservation_skips_the_blocks_a_step_in_flight_writes(tiny_ckpt, room):
    """A decode step launched ahead writes a position into the block of each of its rows. A
    request that ends after that launch frees the block while the write is still to come, so a
    remote prefill (a writer outside the device's stream order) must not be given it. With room
    elsewhere the reservation takes other blocks and does not wait for the step; short of
    exactly that block it waits for the step and then takes it."""
    bs = 4
    e = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=bs, num_blocks=40, async_scheduling=True,
                                                         remote_kv_grace_s=0), progress=False)
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=bs, num_blocks=40), progress=False)
    keep, drop = _prompt(9, 1), _prompt(14, 2)
    e.add_request("keep", keep, GREEDY)
    e.add_request("drop", drop, GREEDY)
    for _ in range(3):
        e.step()
    step = e._inflight
    assert step is not None and [s.request_id for s in step.batch.seqs] == ["keep", "drop"]
    step.ready = _StepNotDone()
    written = step.write_blocks[1]
    e.abort_request("drop")
    blocks = e.scheduler.blocks
    assert written in blocks.free
    free = blocks.num_free_blocks
    need = free - 1 if room == "enough" else free
    res = e.reserve_remote("remote", _prompt(need * bs, 3), GREEDY)
    assert res is not None and len(res["dst_blocks"]) == need
    if room == "enough":
        assert written not in res["dst_blocks"] and step.ready.waits == 0
        assert list(blocks.free) == [written]  # back in the pool once the reservation is made
    else:
        assert written in res["dst_blocks"] and step.ready.waits == 1
    e.fallback_local("remote")  # no prefill server here: the prompt is computed locally
    outs = _run(e)
    want = alone.generate([keep, _prompt(need * bs, 3)], GREEDY)
    assert outs["keep"].output_token_ids == want[0].output_token_ids
    assert outs["remote"].output_token_ids == want[1].output_token_ids
    assert blocks.num_used_blocks == 0 and e._inflight is None


def test_withheld_blocks_sit_out_allocation_and_return_first():
    from engine.block_manager import BlockManager
    from engine.sequence import Sequence
    m = BlockManager(num_blocks=6, block_size=4)
    seq = Sequence("s", list(range(8)), GREEDY)
    with m.withheld([0, 3]):
        m.grow(seq, 12)
        assert seq.block_table == [1, 2, 4]
    assert list(m.free) == [3, 0, 5]
    m.block_hash[5] = b"h"
    with pytest.raises(ValueError, match="block 5 holds a cached prefix"):
        with m.withheld([5]):
            pass
