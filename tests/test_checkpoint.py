"""Checkpoint and config errors are clear and name the problem."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import CheckpointError, load_model
from engine.config import ConfigError, EngineConfig, ModelConfig, preset
from engine.model import DeepseekForCausalLM


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_config_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="hidden_sise: unknown key"):
        ModelConfig.from_dict(dict(preset("tiny").model_dump(), hidden_sise=3))


@pytest.mark.parametrize("override, match", [
    ({"n_group": 3}, "divisible by n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"kv_source_layer_ids": [1, 2]}, "kv_source_layer_ids"),
    ({"kv_source_layer_ids": [0, 9]}, "kv_source_layer_ids"),
    ({"hidden_size": -1}, "hidden_size"),
    ({"rope_scaling": {"type": "linear", "factor": 4}}, "rope_scaling"),
    # DeepSeek-V2's routing: refused, not served as V3's
    ({"scoring_func": "softmax"}, "scoring_func: .*'softmax'.*DeepSeek-V2"),
    ({"topk_method": "group_limited_greedy"}, "topk_method: .*DeepSeek-V2"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
])
def test_invalid_model_config(override, match):
    with pytest.raises(ConfigError, match=match):
        preset("tiny", **override)


def test_v3_routing_keys_are_accepted_and_written(tmp_path):
    """DeepSeek-V3's own values load, and a written config.json names them (transformers reads
    the same file)."""
    cfg = preset("tiny", scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    hf = cfg.to_hf_dict()
    assert (hf["scoring_func"], hf["topk_method"], hf["moe_layer_freq"]) == ("sigmoid", "noaux_tc", 1)
    assert ModelConfig.from_dict(hf) == cfg


def test_unknown_preset_and_engine_field():
    with pytest.raises(ConfigError, match="unknown model preset"):
        preset("huge")
    with pytest.raises(ValueError, match="block_sise"):
        EngineConfig(block_sise=4)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights_are_listed(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"missing weights: .*kv_b_proj.*mlp\.w13"):
        load_model(d, progress=False)


def test_shape_mismatch_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    f = next(d.glob("*.safetensors"))
    tensors = load_file(f)
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=r"shape mismatch for 'model.norm.weight': checkpoint \(65,\)"):
        load_model(d, progress=False)


def test_weights_of_another_config_are_refused(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # layer 3 is then an MTP-style extra layer: skipped, not an error
    (d / "config.json").write_text(json.dumps(cfg))
    assert isinstance(load_model(d, progress=False), DeepseekForCausalLM)
    cfg["kv_lora_rank"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_model(d, progress=False)


def test_no_safetensors(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "ck")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(d, progress=False)


def _stream(engine, prompts, params):
    """Per request: [(token id, text delta)] in the order the engine produced them."""
    out = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", messages=p, params=params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend((t, o.text_delta) for t in o.new_token_ids)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_random_checkpoint_streams_text_for_every_greedy_token(tiny_ckpt, tmp_path, dtype):
    """The random model's tokenizer knows fewer ids than its vocab, and some ids it knows
    decode to nothing: the checkpoint must leave greedy decoding no way to pick those, or
    streamed chunks (and the TTFT / ITL a client measures from them) go missing."""
    from engine import LLMEngine, SamplingParams
    from engine.checkpoint import write_random_checkpoint
    from engine.tokenizer import Tokenizer, text_token_ids

    ckpt = tiny_ckpt if dtype == "float32" else write_random_checkpoint(
        preset("tiny"), tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    tok = Tokenizer(ckpt)
    keep = set(text_token_ids(tok.hf))
    assert 0 < len(keep) < preset("tiny").vocab_size  # the tiny tokenizer does leave ids without text
    head = load_file(next(ckpt.glob("*.safetensors")))["lm_head.weight"]
    zero = (head == 0).all(dim=1)
    assert not zero[sorted(keep)].any() and zero[[i for i in range(len(head)) if i not in keep]].all()

    assert json.loads((ckpt / "random_weights.json").read_text())["output_rows_kept"] == len(keep)
    engine = LLMEngine.from_pretrained(str(ckpt), EngineConfig(dtype=dtype))
    prompts = [[{"role": "user", "content": f"request {i}: write a function that sorts a list"}] for i in range(4)]
    streams = _stream(engine, prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(streams) == 4
    for rid, pieces in streams.items():
        assert len(pieces) == 24
        assert all(t in keep for t, _ in pieces), rid
        assert all(text for _, text in pieces), f"{rid}: a token streamed no text: {pieces}"


def test_a_presets_checkpoint_of_an_older_format_is_written_again(tmp_path):
    from engine.checkpoint import RANDOM_FORMAT, RANDOM_MARKER, ensure_checkpoint
    from engine.tokenizer import CALLS_BEGIN, Tokenizer

    path = ensure_checkpoint("tiny", tmp_path)
    marker = path / RANDOM_MARKER
    assert json.loads(marker.read_text())["format"] == RANDOM_FORMAT
    written = marker.stat().st_mtime_ns
    assert ensure_checkpoint("tiny", tmp_path) == path and marker.stat().st_mtime_ns == written  # kept
    marker.write_text(json.dumps({"seed": 0, "output_rows_kept": 1}))  # as format 1 wrote it
    ensure_checkpoint("tiny", tmp_path)
    assert json.loads(marker.read_text())["format"] == RANDOM_FORMAT
    assert len(Tokenizer(path).encode(CALLS_BEGIN)) == 1  # the new tokenizer came with it
