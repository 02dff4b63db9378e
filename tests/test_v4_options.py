"""V4.1-style options: KV-source sharing, sliding-window KV with replay, sparse (index top-k) attention."""
import torch

from engine.attention import attend, index_topk_mask
from engine.checkpoint import load_weights, random_weights
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.model import DeepseekForCausalLM
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(ckpt, dense=False, **cfg):
    """An engine on the tiny-v4 weights. dense=True turns the indexer's top-k off (k above any
    context): top-k selection is discrete, so a 1e-7 difference in index scores between two
    batch layouts can pick a different entry, and tight equality checks need it off."""
    cfg.setdefault("block_size", 4)
    if dense:
        model = DeepseekForCausalLM(preset("tiny-v4", index_topk=10_000))
        load_weights(model, random_weights(preset("tiny-v4")), progress=False)
        engine = LLMEngine(model.eval(), None, EngineConfig(**cfg))
    else:
        engine = LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)
    engine.recorded, engine.computed = [], []
    sample, run = engine.runner.sample, engine.runner.run

    def record(seqs, logits):
        engine.recorded.append(logits.clone())
        return sample(seqs, logits)

    def count(batch):
        engine.computed.append(sum(batch.num_tokens))
        return run(batch)
    engine.runner.sample, engine.runner.run = record, count
    return engine


def _prompt(n, seed=0):
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_only_source_layers_hold_global_kv(tiny_v4_ckpt):
    engine = _engine(tiny_v4_ckpt)
    cfg = engine.model_cfg
    assert cfg.kv_source_layer_ids == [0, 2]
    assert engine.runner.kv.global_kv.shape[0] == 2
    layers = engine.runner.model.model.layers
    assert [layer.self_attn.source for layer in layers] == [0, 0, 1, 1]
    # Changing source 1's cached latents changes what layers 2 and 3 read, not layers 0 and 1.
    prompt = _prompt(20)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert engine.runner.kv.global_kv[1].abs().sum() > 0


def test_chunked_prefill_with_window_equals_one_chunk(tiny_v4_ckpt):
    a = _engine(tiny_v4_ckpt, dense=True, max_num_batched_tokens=512, enable_prefix_caching=False)
    b = _engine(tiny_v4_ckpt, dense=True, max_num_batched_tokens=5, enable_prefix_caching=False)
    prompt = _prompt(50)
    oa = a.generate([prompt], GREEDY)[0]
    ob = b.generate([prompt], GREEDY)[0]
    assert oa.output_token_ids == ob.output_token_ids
    for x, y in zip(a.recorded, b.recorded):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_exact_replay_equals_cold_run(tiny_v4_ckpt):
    warm = _engine(tiny_v4_ckpt, dense=True, replay_mode="exact")
    cold = _engine(tiny_v4_ckpt, dense=True, replay_mode="exact")
    prefix, suffix = _prompt(72, 1), _prompt(3, 2)
    warm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    warm.recorded.clear()
    hot = warm.generate([prefix + suffix], GREEDY)[0]
    ref = cold.generate([prefix + suffix], GREEDY)[0]
    hit = 72  # block-aligned and below the prompt length
    w, layers = warm.model_cfg.sliding_window, warm.model_cfg.num_hidden_layers
    assert hot.num_cached_tokens == hit
    assert warm.stats()["replayed_tokens"] == w * layers
    assert hot.output_token_ids == ref.output_token_ids
    for x, y in zip(warm.recorded, cold.recorded):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_bounded_replay_recomputes_exactly_the_window(tiny_v4_ckpt):
    engine = _engine(tiny_v4_ckpt, replay_mode="bounded")
    prefix, suffix = _prompt(72, 1), _prompt(10, 2)
    engine.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    engine.computed.clear()
    out = engine.generate([prefix + suffix], SamplingParams(max_tokens=1, temperature=0))[0]
    w = engine.model_cfg.sliding_window
    assert out.num_cached_tokens == 72
    assert engine.stats()["replayed_tokens"] == w
    assert sum(engine.computed) == len(suffix) + w  # the uncached suffix plus W replayed tokens, nothing more


def test_bounded_replay_stays_close_to_cold(tiny_v4_ckpt):
    warm = _engine(tiny_v4_ckpt, dense=True, replay_mode="bounded")
    cold = _engine(tiny_v4_ckpt, dense=True)
    prefix, suffix = _prompt(72, 1), _prompt(3, 2)  # a short suffix: the approximation shows most
    warm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))
    warm.recorded.clear()
    warm.generate([prefix + suffix], SamplingParams(max_tokens=1, temperature=0))
    cold.generate([prefix + suffix], SamplingParams(max_tokens=1, temperature=0))
    a, b = warm.recorded[0], cold.recorded[0]
    # An approximation: close, but it is not the cold computation (so the exact test can fail).
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).item() > 0.9
    assert not torch.allclose(a, b, atol=1e-4)


def _pair(cfg_a, cfg_b):
    """Two models with the same weights (indexer weights too) but different configs."""
    models = []
    for cfg in (cfg_a, cfg_b):
        m = DeepseekForCausalLM(cfg)
        load_weights(m, random_weights(preset("tiny-v4"), seed=3), progress=False)
        models.append(m.eval())
    return models


def test_index_topk_at_least_context_is_dense_attention():
    prompt = _prompt(40, 5)
    outs = []
    for topk in (10_000, 52):  # both >= every query's number of candidates (40 + 12 tokens)
        cfg = preset("tiny-v4", index_topk=topk)
        model = DeepseekForCausalLM(cfg)
        load_weights(model, random_weights(preset("tiny-v4"), seed=3), progress=False)
        engine = LLMEngine(model.eval(), None, EngineConfig(block_size=4))
        outs.append(engine)
    dense_cfg = preset("tiny-v4", index_topk=None)
    dense_model = DeepseekForCausalLM(dense_cfg)
    state = {k: v for k, v in outs[0].runner.model.state_dict().items() if ".indexer." not in k}
    dense_model.load_state_dict(state)
    dense = LLMEngine(dense_model.eval(), None, EngineConfig(block_size=4))
    results = []
    for engine in outs + [dense]:
        seen = []
        sample = engine.runner.sample
        engine.runner.sample = lambda seqs, logits, seen=seen, sample=sample: (seen.append(logits.clone()), sample(seqs, logits))[1]
        out = engine.generate([prompt], GREEDY)[0]
        results.append((out.output_token_ids, seen))
    for tokens, logits in results[:2]:
        assert tokens == results[2][0]
        # The same attention; the input projection's GEMM is wider with the indexer's rows fused
        # in, and some BLAS builds (MKL with AVX-512, for one row) round the shared columns differently.
        for x, y in zip(logits, results[2][1]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_small_topk_reads_only_the_chosen_entries():
    g = torch.Generator().manual_seed(0)
    b, n, h, c, d, kv_lora, hi, di, k = 2, 3, 4, 32, 24, 16, 2, 8, 5
    q = torch.randn(b, n, h, d, generator=g)
    keys = torch.randn(b, c, d, generator=g)
    mask = torch.ones(b, n, c, dtype=torch.bool)
    mask[1, :, 20:] = False  # a shorter second sequence
    idx_q, idx_w, idx_k = torch.randn(b, n, hi, di, generator=g), torch.rand(b, n, hi, generator=g), torch.randn(b, c, di, generator=g)
    sel = index_topk_mask(idx_q, idx_w, idx_k, mask, k)
    assert (sel.sum(-1) == k).all() and not (sel & ~mask).any()
    out = attend(q, keys, sel, 0.1, kv_lora)
    # Garbage in every entry that was not chosen must not change the result.
    poisoned = keys.clone()
    unread = ~sel.any(1)  # [b, c] entries no query chose
    poisoned[unread] = 1e4 * torch.randn(int(unread.sum()), d, generator=g)
    assert torch.equal(attend(q, poisoned, sel, 0.1, kv_lora), out)
    # ...while the dense result does depend on them.
    assert not torch.allclose(attend(q, keys, mask, 0.1, kv_lora), out)


def test_sparse_model_runs_long_prompt_and_differs_from_dense(tiny_v4_ckpt):
    engine = _engine(tiny_v4_ckpt)  # index_topk 16 over a 60-token context
    out = engine.generate([_prompt(60, 9)], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.output_token_ids) == 4
    assert engine.stats()["kv_blocks_used"] == 0
