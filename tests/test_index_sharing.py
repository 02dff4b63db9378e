"""Index sharing (EngineConfig.index_topk_freq / index_topk_pattern): layers that reuse the
latest scoring layer's top-k instead of scoring the global KV themselves."""
import pytest
import torch
from pydantic import ValidationError

import engine.model as model_mod
from app.config import ConfigError as AppConfigError, parse_app_config
from engine.config import ConfigError, EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _engine(ckpt, **cfg):
    cfg.setdefault("block_size", 4)
    return LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)


def _generate(ckpt, prompts, **cfg):
    """Greedy outputs and every sampled step's logits; no KV block left behind."""
    engine = _engine(ckpt, **cfg)
    logits, sample = [], engine.runner.sample
    engine.runner.sample = lambda seqs, lg: logits.append(lg.clone()) or sample(seqs, lg)
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.blocks.num_used_blocks == 0
    return [o.output_token_ids for o in outs], logits


def test_freq_and_pattern_say_which_layers_score():
    tiny_v4 = preset("tiny-v4")  # 4 layers
    assert EngineConfig().index_scoring_layers(tiny_v4) == [True] * 4
    assert EngineConfig(index_topk_freq=2).index_scoring_layers(tiny_v4) == [True, False, True, False]
    assert EngineConfig(index_topk_freq=3).index_scoring_layers(tiny_v4) == [True, False, False, True]
    assert EngineConfig(index_topk_pattern="ffsf").index_scoring_layers(tiny_v4) == [True, True, False, True]


@pytest.mark.parametrize("kw,match", [
    (dict(index_topk_freq=0), "index_topk_freq"),
    (dict(index_topk_pattern="FSX"), "index_topk_pattern"),
    (dict(index_topk_pattern="SFFF"), "index_topk_pattern"),
    (dict(index_topk_pattern=""), "index_topk_pattern"),
])
def test_bad_values_fail_naming_the_field(kw, match):
    with pytest.raises(ValidationError, match=match):
        EngineConfig(**kw)


def test_pattern_of_the_wrong_length_or_a_model_without_indexer_fails_at_start(tiny_ckpt, tiny_v4_ckpt):
    with pytest.raises(ConfigError, match="index_topk_pattern: 3 letters for a model of 4 layers"):
        _engine(tiny_v4_ckpt, index_topk_pattern="FSF")
    with pytest.raises(ConfigError, match="index_topk_freq"):
        _engine(tiny_ckpt, index_topk_freq=2)  # tiny has no indexer
    _engine(tiny_ckpt, index_topk_freq=1)  # the default stays valid for every model


def test_app_config_names_the_engine_field():
    with pytest.raises(AppConfigError, match="engine.index_topk_pattern"):
        parse_app_config({"engine": {"index_topk_pattern": "SF"}})


def test_reusing_layers_neither_project_nor_score(tiny_v4_ckpt, monkeypatch):
    """Padded path: the scoring layers call the indexer's top-k, the others attend with exactly
    the mask the latest scoring layer chose; and their fused projection has no indexer columns."""
    engine = _engine(tiny_v4_ckpt, index_topk_pattern="FSSF", decode_kernels=False)
    layers = [layer.self_attn for layer in engine.runner.model.model.layers]
    assert [a.scores for a in layers] == [True, False, False, True]
    x = torch.randn(3, engine.model_cfg.hidden_size)
    assert "idx_q" in layers[0].project(x) and "idx_q" not in layers[1].project(x)
    assert "idx_k" in layers[2].project(x)  # a source layer that reuses still writes its index keys

    chosen, masks = [], []
    real_mask, real_attend = model_mod.index_topk_mask, model_mod.attend
    monkeypatch.setattr(model_mod, "index_topk_mask", lambda *a: chosen.append(real_mask(*a)) or chosen[-1])
    monkeypatch.setattr(model_mod, "attend", lambda q, keys, mask, *a: masks.append(mask) or real_attend(q, keys, mask, *a))
    engine.generate(_prompts([40]), SamplingParams(max_tokens=1, temperature=0))
    assert len(chosen) == 2 and len(masks) == 4  # one forward: two scoring layers of four
    c = chosen[0].shape[-1]
    assert torch.equal(masks[1][..., :c], masks[0][..., :c]) and torch.equal(masks[2][..., :c], masks[0][..., :c])
    assert torch.equal(masks[3][..., :c], chosen[1][..., :c]) and not torch.equal(chosen[0], chosen[1])


def test_decode_kernels_reuse_the_scoring_layers_positions(tiny_v4_ckpt, monkeypatch):
    engine = _engine(tiny_v4_ckpt, index_topk_freq=2)
    seen, real = [], model_mod.decode_attention
    monkeypatch.setattr(model_mod, "decode_attention", lambda attn, q, pos, *a: seen.append(pos) or real(attn, q, pos, *a))
    engine.generate(_prompts([40]), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    decode = seen[-4:]  # the last step: a decode step of 4 layers, sparse at 40+ positions
    assert all(p is not None for p in decode)
    assert decode[1] is decode[0] and decode[3] is decode[2] and not torch.equal(decode[0], decode[2])


def test_decode_kernels_match_padded_path_with_sharing(tiny_v4_ckpt):
    prompts = _prompts([3, 30, 45, 1])
    fast, fast_logits = _generate(tiny_v4_ckpt, prompts, index_topk_freq=2)
    slow, slow_logits = _generate(tiny_v4_ckpt, prompts, index_topk_freq=2, decode_kernels=False)
    assert fast == slow
    for a, b in zip(fast_logits, slow_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_sharing_changes_only_sparse_contexts(tiny_v4_ckpt):
    # Up to index_topk (16) global positions every key is read, so there is nothing to share.
    short = _prompts([6])
    _, every = _generate(tiny_v4_ckpt, short)
    _, shared = _generate(tiny_v4_ckpt, short, index_topk_freq=4)
    for a, b in zip(every, shared):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    long = _prompts([60])
    _, every = _generate(tiny_v4_ckpt, long)
    _, shared = _generate(tiny_v4_ckpt, long, index_topk_freq=4)
    assert not torch.allclose(every[0], shared[0], atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sharing_in_cuda_graphs_on_gpu(tiny_v4_ckpt):
    prompts = _prompts([3, 30, 45, 1, 70])
    kw = dict(device="cuda", index_topk_pattern="FSFS")
    fast, fast_logits = _generate(tiny_v4_ckpt, prompts, cuda_graphs=True, **kw)
    slow, slow_logits = _generate(tiny_v4_ckpt, prompts, decode_kernels=False, cuda_graphs=False, **kw)
    assert fast == slow
    for a, b in zip(fast_logits, slow_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
