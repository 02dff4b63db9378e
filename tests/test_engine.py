"""Scheduler, KV blocks, prefix cache, preemption and request errors of the engine."""
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompt(n, seed=0):
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pool_is_empty(engine):
    s = engine.scheduler
    assert s.blocks.num_used_blocks == 0
    assert all(r == 0 for r in s.blocks.ref_count)
    assert not s.running and not s.waiting and not engine.requests
    if s.window_slots is not None:
        assert len(s.window_slots.free) == engine.cfg.max_num_seqs


def test_prefix_cache_hit_counts_and_same_output(tiny_ckpt):
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    cold = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, enable_prefix_caching=False),
                                     progress=False)
    turn1 = _prompt(30, 1)
    first = engine.generate([turn1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    turn2 = turn1 + first.output_token_ids + _prompt(9, 2)
    second = engine.generate([turn2], GREEDY)[0]
    # Every full block of turn 1's prompt and output whose KV was computed is reused.
    assert second.num_cached_tokens == ((len(turn1) + len(first.output_token_ids) - 1) // 4) * 4
    assert second.output_token_ids == cold.generate([turn2], GREEDY)[0].output_token_ids
    _pool_is_empty(engine)


def test_each_output_keeps_its_own_token_ids(tiny_ckpt):
    """Outputs share the sequence's growing token list instead of copying it per token: an
    earlier output must still read only the tokens it had, also after a round trip by pickle."""
    import pickle
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    engine.add_request("r", _prompt(12), GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(outs) == len(tokens) == 10
    for i, out in enumerate(outs):
        assert out.output_token_ids == tokens[:i + 1]
        assert pickle.loads(pickle.dumps(out)).output_token_ids == tokens[:i + 1]
    outs[0].output_token_ids.append(-1)  # a reader's list is its own
    assert outs[0].output_token_ids == tokens[:1] and outs[-1].output_token_ids == tokens


def test_preemption_by_recompute_gives_the_same_tokens(tiny_ckpt):
    prompts = [_prompt(20 + 3 * i, i) for i in range(6)]
    roomy = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=512), progress=False)
    tight = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=24, max_model_len=64),
                                      progress=False)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expect = [o.output_token_ids for o in roomy.generate(prompts, params)]
    got = [o.output_token_ids for o in tight.generate(prompts, params)]
    assert tight.stats()["preemptions"] > 0
    assert got == expect
    _pool_is_empty(tight)


def test_each_block_is_hashed_once_through_retries_and_preemption(tiny_ckpt, monkeypatch):
    """Admission looks up the prefix cache on every attempt (each step while the pool is full,
    again after a preemption) and publishing hashes computed blocks: all of them read the
    sequence's own chain of block hashes, so no block of a sequence is hashed twice."""
    from engine import block_manager
    calls = []
    real = block_manager.block_hash
    monkeypatch.setattr(block_manager, "block_hash", lambda prev, tokens: calls.append(1) or real(prev, tokens))
    tight = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=24, max_model_len=64),
                                      progress=False)
    prompts = [_prompt(20 + 3 * i, i) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = tight.generate(prompts, params)
    assert tight.stats()["preemptions"] > 0
    full_blocks = sum((len(p) + len(o.output_token_ids)) // 4 for p, o in zip(prompts, outs))
    assert 0 < len(calls) <= full_blocks
    _pool_is_empty(tight)


@pytest.mark.parametrize("ckpt", ["tiny_ckpt", "tiny_v4_ckpt"])
def test_block_pool_empty_after_random_mix(ckpt, request):
    """Finished, aborted and failed requests, with preemption and chunked prefill."""
    path = request.getfixturevalue(ckpt)
    engine = LLMEngine.from_pretrained(path, EngineConfig(block_size=4, num_blocks=40, max_num_seqs=6,
                                                          max_num_batched_tokens=32, max_model_len=100),
                                       progress=False)
    rng = random.Random(0)
    run = engine.runner.run
    failures = {"left": 3}

    def flaky(batch):
        if rng.random() < 0.05 and failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected step failure")
        return run(batch)
    engine.runner.run = flaky
    reasons = {}
    shared = _prompt(24, 99)
    for i in range(40):
        prompt = (shared if rng.random() < 0.5 else []) + _prompt(rng.randint(1, 40), i)
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 0.8]), seed=i)
        engine.add_request(f"r{i}", prompt, params)
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        steps += 1
        if steps % 7 == 0 and engine.requests:
            victim = rng.choice(sorted(engine.requests))
            out = engine.abort_request(victim)
            reasons[victim] = out.finish_reason
        assert steps < 5000
    assert len(reasons) == 40
    assert {"length", "abort", "error"} <= set(reasons.values())
    assert engine.stats()["preemptions"] > 0
    _pool_is_empty(engine)


def test_a_chat_template_that_fails_is_a_request_error(tiny_ckpt):
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4), progress=False)
    engine.tokenizer.hf.chat_template = "{{ raise_exception('tool messages must follow a call') }}"
    with pytest.raises(RequestError, match="chat template failed.*must follow a call"):
        engine.add_request("t", messages=[{"role": "tool", "content": "x"}])
    engine.tokenizer.hf.chat_template = None
    with pytest.raises(RequestError, match="no chat template"):
        engine.add_request("t", messages=[{"role": "user", "content": "x"}])
    assert not engine.requests and engine.stats()["kv_blocks_used"] == 0


def test_request_errors_name_the_problem(tiny_ckpt):
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=16), progress=False)
    with pytest.raises(RequestError, match="context limit is 64"):
        engine.add_request("long", _prompt(64))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.add_request("vocab", [1, 2, 100000])
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [])
    with pytest.raises(RequestError, match="exactly one of prompt or messages"):
        engine.add_request("none", None)
    with pytest.raises(RequestError, match="messages must be"):
        engine.add_request("msgs", messages=[{"role": "user"}])
    with pytest.raises(RequestError, match="a string, a list of token ids or"):
        engine.add_request("type", 42)
    with pytest.raises(RequestError, match="prefix, suffix"):
        engine.add_request("fim", {"prefix": "a"})
    engine.add_request("ok", "hello")
    with pytest.raises(RequestError, match="duplicate request id"):
        engine.add_request("ok", "hello")
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=16, max_model_len=1000),
                                  progress=False)


def test_generation_stops_at_context_limit(tiny_ckpt):
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(block_size=4, num_blocks=8), progress=False)
    out = engine.generate([_prompt(30)], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert 30 + len(out.output_token_ids) == 32
    _pool_is_empty(engine)


def test_chat_messages_use_the_checkpoint_template(tiny_ckpt):
    engine = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(), progress=False)
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    text = engine.tokenizer.hf.decode(ids)
    assert text.startswith("<｜begin▁of▁sentence｜><｜User｜>hi") and text.endswith("<｜Assistant｜>")
    out = engine.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.num_prompt_tokens == len(ids)


def test_grouped_expert_gemm_equals_the_per_expert_loop():
    from engine import moe as moe_mod
    from engine.config import preset
    cfg = preset("tiny")
    layer = moe_mod.MoE(cfg)
    torch.nn.init.normal_(layer.w13, std=0.1)
    torch.nn.init.normal_(layer.w2, std=0.1)
    torch.nn.init.normal_(layer.gate.weight, std=0.1)
    x = torch.randn(37, cfg.hidden_size)
    assert moe_mod._grouped_mm_ok(x, layer.w13)
    fused = layer(x)
    moe_mod._GROUPED_MM_DISABLED = True
    try:
        looped = layer(x)
    finally:
        moe_mod._GROUPED_MM_DISABLED = False
    torch.testing.assert_close(fused, looped, atol=1e-5, rtol=1e-5)
    assert int(layer.take_load().sum()) == 2 * 37 * cfg.num_experts_per_tok


def test_fused_projections_share_the_parameters_storage():
    """The fused GEMM's concatenated weight is the parameters' own storage (no second copy of
    the weights), and a later write or load into a parameter is what the next forward uses."""
    import torch.nn.functional as F

    from engine.layers import MLP
    torch.manual_seed(0)
    mlp, x = MLP(8, 16), torch.randn(3, 8)

    def unfused():
        return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    want = unfused()
    with torch.inference_mode():
        got = mlp(x)
    torch.testing.assert_close(got, want)
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    assert gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
    assert up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()
    with torch.no_grad():
        up.mul_(2)  # a write outside inference mode still works, and is seen
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), unfused())
    mlp.load_state_dict({k: torch.full_like(v, 0.1) for k, v in mlp.state_dict().items()})
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), unfused())


def test_derived_weight_refreshes_in_place():
    """A cast weight rebuilt after a write keeps its memory (captured CUDA graphs read it)."""
    from engine.layers import DerivedWeight
    w = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    cache = DerivedWeight()
    first = cache.get([w], w.float)
    with torch.no_grad():
        w.mul_(2)
    second = cache.get([w], w.float)
    assert second is first and torch.equal(second, w.float())
