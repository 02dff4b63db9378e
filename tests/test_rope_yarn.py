"""YaRN rope scaling, as every released DeepSeek-V2/V3/R1 config has it, against transformers'
DeepseekV3ForCausalLM loaded from the same checkpoint: the rotary tables, the softmax scale, and
the logits of prefill, prompt chunks as kernel rows and decode steps past the original context."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_chunk_rows import EagerGraphs

from engine.checkpoint import write_random_checkpoint
from engine.config import PRESETS, ConfigError, EngineConfig, ModelConfig, preset
from engine.layers import Rotary
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    DeepseekV3Attention, DeepseekV3RotaryEmbedding)

# As in every released DeepSeek-V3 / R1 config.json (V2-Lite: mscale and mscale_all_dim 0.707).
V3_ROPE = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096, "type": "yarn"}
TINY = PRESETS["tiny-yarn"]["rope_scaling"]
ORIGINAL = TINY["original_max_position_embeddings"]
ROPES = {
    "v2-lite": TINY,  # mscale == mscale_all_dim != 1: tables unscaled, softmax scale changed
    "v3": dict(TINY, mscale=1.0, mscale_all_dim=1.0),
    "unequal": dict(TINY, mscale=1.0, mscale_all_dim=0.5),  # the tables scaled as well
}
ATOL, RTOL = 2e-5, 1e-4  # test_oracle's
# Random weights of std 0.02 leave attention almost uniform, so positions barely move the logits
# and a wrong rope would hide under the tolerance. Queries and the latent (rope key included)
# 8x larger make attention peaked: a rope without YaRN then moves logits by 1e-2 and more.
SHARPEN = 8.0
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _hf_dict(cfg: ModelConfig) -> dict:
    return {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}


def _prompt(n, seed=0):
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(ROPES))
def yarn_ckpt(request, tmp_path_factory):
    cfg = preset("tiny-yarn", rope_scaling=ROPES[request.param])
    ckpt = write_random_checkpoint(cfg, tmp_path_factory.mktemp(f"yarn-{request.param}"), progress=False)
    for f in ckpt.glob("*.safetensors"):
        tensors = load_file(f)
        for name in tensors:
            if name.endswith(("q_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                tensors[name] = tensors[name] * SHARPEN
        save_file(tensors, f, metadata={"format": "pt"})
    return ckpt


@pytest.fixture(scope="module")
def hf_yarn(yarn_ckpt):
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(yarn_ckpt), dtype=torch.float32).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    return model


def _engine(ckpt, chunk_rows=False, **cfg):
    """An engine recording the logits of every sampled step (per step, {prompt length: logits});
    chunk_rows: prompt chunks run as rows of the decode kernels (test_chunk_rows' stand-in for the
    GPU's chunk graphs)."""
    cfg = dict(dict(block_size=4, num_blocks=256, max_num_seqs=8), **cfg)
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)
    if chunk_rows:
        engine.runner.graphs = EagerGraphs(engine.runner)
    engine.recorded = []
    sample = engine.runner.sample

    def record(seqs, logits):
        engine.recorded.append({len(seq.prompt_ids): logits[i].clone() for i, seq in enumerate(seqs)})
        return sample(seqs, logits)
    engine.runner.sample = record
    return engine


def _last_prompt_logits(engine, prompt, lengths):
    """Our logits at the last position of each prefix of `prompt`, all prefilled in one batch."""
    engine.generate([prompt[:n] for n in lengths], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    logits = {n: row for step in engine.recorded for n, row in step.items()}
    return torch.stack([logits[n] for n in lengths])


LENGTHS = [30, ORIGINAL, ORIGINAL + 1, 100, 150]


@pytest.mark.parametrize("budget", [512, 7])
def test_prefill_matches_transformers_past_the_original_context(yarn_ckpt, hf_yarn, budget):
    prompt = _prompt(max(LENGTHS))
    with torch.no_grad():
        hf = hf_yarn(torch.tensor([prompt])).logits[0]
    ours = _last_prompt_logits(_engine(yarn_ckpt, max_num_batched_tokens=budget), prompt, LENGTHS)
    for row, n in enumerate(LENGTHS):
        torch.testing.assert_close(ours[row], hf[n - 1], atol=ATOL, rtol=RTOL, msg=f"prompt of {n}")


@pytest.mark.parametrize("chunk_rows", [False, True], ids=["padded", "chunk-rows"])
def test_decode_steps_match_transformers(yarn_ckpt, hf_yarn, chunk_rows):
    prompt = _prompt(150, seed=1)
    with torch.no_grad():
        out = hf_yarn.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    hf_tokens, hf_logits = out.sequences[0, len(prompt):].tolist(), [l[0] for l in out.logits]
    engine = _engine(yarn_ckpt, chunk_rows, max_num_batched_tokens=24)
    ours = engine.generate([prompt], GREEDY)[0]
    if chunk_rows:
        assert engine.runner.graphs.chunks, "no prompt chunk ran as kernel rows"
    assert len(engine.recorded) == GREEDY.max_tokens
    for step, (a, b) in enumerate(zip(engine.recorded, hf_logits)):
        torch.testing.assert_close(a[len(prompt)], b.float(), atol=ATOL, rtol=RTOL,
                                   msg=f"step {step} (position {len(prompt) - 1 + step})")
    assert ours.output_token_ids == hf_tokens


def test_without_yarn_the_comparison_fails(yarn_ckpt, hf_yarn, tmp_path):
    """The same weights with plain rope, or with YaRN's tables but not its softmax scale, are far
    outside the tolerance past the original context: the tests above can fail."""
    prompt = _prompt(150)
    lengths = [100, 150]
    with torch.no_grad():
        hf = hf_yarn(torch.tensor([prompt])).logits[0][[n - 1 for n in lengths]]

    plain = shutil.copytree(yarn_ckpt, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    del config["rope_scaling"]
    (plain / "config.json").write_text(json.dumps(config))
    engine = _engine(plain)
    assert engine.model_cfg.rope_yarn is None
    assert (_last_prompt_logits(engine, prompt, lengths) - hf).abs().max() > 1e-2

    engine = _engine(yarn_ckpt)
    cfg = engine.model_cfg
    if cfg.rope_yarn.softmax_mscale != 1.0:
        for layer in engine.runner.model.model.layers:
            layer.self_attn.scale = cfg.qk_head_dim ** -0.5
        assert (_last_prompt_logits(engine, prompt, lengths) - hf).abs().max() > 5e-3


@pytest.mark.parametrize("rope, dim, max_pos", [
    (TINY, 8, 256),
    (ROPES["unequal"], 8, 256),
    (V3_ROPE, 64, 163840),
    (dict(V3_ROPE, mscale=0.707, mscale_all_dim=0.707), 64, 163840),  # DeepSeek-V2-Lite
    (dict(type="yarn", factor=8, original_max_position_embeddings=64, truncate=False, attention_factor=1.3), 16, 512),
    (dict(rope_type="yarn", factor=4, rope_theta=500.0), 8, 128),  # transformers 5 naming, defaults
], ids=["tiny", "unequal", "v3", "v2-lite", "no-truncate", "defaults"])
def test_tables_and_softmax_scale_match_transformers(rope, dim, max_pos):
    cfg = preset("tiny", rope_scaling=rope, qk_rope_head_dim=dim, max_position_embeddings=max_pos)
    hf_cfg = DeepseekV3Config(**_hf_dict(cfg))
    hf_rotary = DeepseekV3RotaryEmbedding(hf_cfg)
    ours = Rotary(dim, cfg.rope_base, cfg.rope_interleave, max_pos, "cpu", cfg.rope_yarn)
    exact = dict(atol=0, rtol=0)
    torch.testing.assert_close(ours.inv_freq, hf_rotary.inv_freq, **exact)
    assert ours.table_scale == hf_rotary.attention_scaling
    positions = torch.arange(0, max_pos, max(1, max_pos // 4096))
    cos, sin = hf_rotary(torch.zeros(1), positions[None])
    # transformers' tables are the angles twice over; the first half is the one per pair.
    torch.testing.assert_close(ours.tables(positions)[0], cos[0, :, :dim // 2], **exact)
    torch.testing.assert_close(ours.tables(positions)[1], sin[0, :, :dim // 2], **exact)
    assert cfg.softmax_scale == DeepseekV3Attention(hf_cfg, 0).scaling


def test_every_attention_path_reads_the_scaled_softmax_scale(yarn_ckpt):
    engine = _engine(yarn_ckpt)
    cfg = engine.model_cfg
    yarn = cfg.rope_yarn
    m = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1
    assert cfg.softmax_scale == pytest.approx(cfg.qk_head_dim ** -0.5 * m * m, rel=1e-12)
    assert all(layer.self_attn.scale == cfg.softmax_scale for layer in engine.runner.model.model.layers)


def test_real_deepseek_v3_config_is_accepted():
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06, "rope_scaling": V3_ROPE, "rope_theta": 10000, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
        "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    }
    cfg = ModelConfig.from_dict(config)
    yarn = cfg.rope_yarn
    assert (yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow) == (40, 4096, 32, 1)
    assert yarn.table_scale == 1.0  # mscale == mscale_all_dim
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert cfg.softmax_scale == DeepseekV3Attention(DeepseekV3Config(**_hf_dict(cfg)), 0).scaling


def test_rope_dict_is_read_as_transformers_reads_it():
    # "rope_type" over "type"; rope_theta inside the dict over the top-level one
    cfg = preset("tiny", rope_parameters={"rope_type": "yarn", "type": "default", "factor": 4, "rope_theta": 500.0})
    assert cfg.rope_yarn is not None and cfg.rope_base == 500.0
    # rope_scaling (the released configs' name) wins whole over rope_parameters
    cfg = preset("tiny", rope_scaling={"type": "yarn", "factor": 4},
                 rope_parameters={"rope_type": "default", "rope_theta": 7.0})
    assert cfg.rope_yarn is not None and cfg.rope_base == 10000.0
    # transformers' default for a missing original length is max_position_embeddings
    assert cfg.rope_yarn.original_max_position_embeddings == cfg.max_position_embeddings
    assert preset("tiny").rope_yarn is None
    assert preset("tiny").softmax_scale == preset("tiny").qk_head_dim ** -0.5
    # what the checkpoint writer puts in config.json is what transformers then uses
    cfg = preset("tiny", rope_parameters={"rope_type": "yarn", "factor": 4, "rope_theta": 500.0})
    hf = DeepseekV3Config(**_hf_dict(cfg))
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["rope_theta"] == 500.0


@pytest.mark.parametrize("rope, match", [
    ({"type": "yarn"}, r"rope_scaling\.factor: yarn needs a factor"),
    ({"type": "yarn", "factor": None}, r"rope_scaling\.factor"),
    ({"type": "yarn", "factor": 0}, r"rope_scaling\.factor must be > 0"),
    ({"type": "yarn", "factor": "40"}, r"rope_scaling\.factor must be a number"),
    ({"type": "yarn", "factor": 4, "original_max_position_embeddings": 0},
     r"rope_scaling\.original_max_position_embeddings"),
    ({"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32}, r"rope_scaling\.beta_fast"),
    ({"type": "yarn", "factor": 4, "mscale": "big"}, r"rope_scaling\.mscale must be a number"),
    ({"type": "yarn", "factor": 4, "attention_factor": -1.0}, r"rope_scaling\.attention_factor"),
    ({"type": "yarn", "factor": 4, "truncate": "yes"}, r"rope_scaling\.truncate"),
    ({"type": "yarn", "factor": 4, "factr": 4}, r"rope_scaling: unknown yarn keys \['factr'\]"),
    ({"type": "linear", "factor": 4}, r"rope_scaling type 'linear' is not supported \(only 'default' and 'yarn'\)"),
    ({"rope_type": "dynamic", "factor": 4}, r"rope_scaling type 'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8}, r"rope_scaling type 'llama3' is not supported"),
    ({"type": "longrope"}, r"rope_scaling type 'longrope' is not supported"),
])
def test_bad_rope_config_names_the_field(rope, match):
    with pytest.raises(ConfigError, match=match):
        preset("tiny", rope_scaling=rope)


def test_bad_rope_parameters_are_named_as_such():
    with pytest.raises(ConfigError, match=r"rope_parameters\.factor"):
        preset("tiny", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match=r"rope_parameters type 'linear'"):
        preset("tiny", rope_parameters={"rope_type": "linear", "factor": 2})


def test_v4_options_under_yarn_chunk_rows_equal_the_padded_path(tmp_path):
    """The window and indexer paths (no oracle) read the same tables and softmax scale: prompts
    as kernel rows, beside decoding sequences, and decode steps in the kernels give what the
    padded path alone (decode_kernels off) gives, past the original context."""
    ckpt = write_random_checkpoint(preset("tiny-v4", rope_scaling=TINY, max_position_embeddings=256), tmp_path,
                                   progress=False)
    prompts = [_prompt(n, seed=n) for n in (5, 21, 90, 13)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs, logits = {}, {}
    for chunk_rows in (False, True):
        engine = _engine(ckpt, chunk_rows, max_num_batched_tokens=24, decode_kernels=chunk_rows)
        outs[chunk_rows] = [o.output_token_ids for o in engine.generate(prompts, params)]
        logits[chunk_rows] = engine.recorded
        if chunk_rows:
            assert engine.runner.graphs.chunks
    assert outs[True] == outs[False]
    for a, b in zip(logits[True], logits[False]):
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(a[n], b[n], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_graphs_and_kernels_match_transformers(yarn_ckpt, hf_yarn):
    """On the GPU (tables built on the device, prompt chunks and decode steps from CUDA graphs,
    the Triton rope, latent and attention kernels) against transformers on the CPU."""
    prompt = _prompt(150, seed=1)
    with torch.no_grad():
        out = hf_yarn.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    hf_tokens, hf_logits = out.sequences[0, len(prompt):].tolist(), [l[0] for l in out.logits]
    engine = _engine(yarn_ckpt, device="cuda", max_num_batched_tokens=24, warmup=False)
    ours = engine.generate([prompt], GREEDY)[0]
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    for step, (a, b) in enumerate(zip(engine.recorded, hf_logits)):
        torch.testing.assert_close(a[len(prompt)].cpu(), b.float(), atol=1e-4, rtol=1e-4, msg=f"step {step}")
    assert ours.output_token_ids == hf_tokens
