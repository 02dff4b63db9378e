"""DeepSeek's block FP8 checkpoints (deepseek-ai/DeepSeek-V3's layout) load, dequantized."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import checkpoint
from engine.checkpoint import CheckpointError, iter_checkpoint, load_model, write_random_checkpoint
from engine.config import ConfigError, EngineConfig, ModelConfig, preset
from wideep_kernels.fp8_blocks import dequantize_experts, dequantize_fp8_blocks, quantize_fp8_blocks
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

# what deepseek-ai/DeepSeek-V3's config.json carries
DEEPSEEK_V3_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": [128, 128]}
SHAPES = [(64, 64), (48, 64), (40, 64), (128, 32), (96, 48), (1, 5), (300, 200)]
BLOCKS = [(16, 16), (32, 32), (128, 128), (16, 32)]


def _blockwise(shape, block, seed=0):
    """Random weights whose magnitude differs by orders of magnitude from block to block, with
    one all-zero block: a single scale for the whole tensor would fail the error bounds."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    nbo, nbi = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    mag = 10.0 ** torch.randint(-6, 3, (nbo, nbi), generator=g).float()
    mag[-1, -1] = 0
    per_element = mag.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return torch.randn(shape, generator=g) * per_element


def _block_views(t, block):
    rows, cols = t.shape
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            yield (i // block[0], j // block[1]), t[i:i + block[0], j:j + block[1]]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_is_within_e4m3_precision(shape, block):
    w = _blockwise(shape, block)
    q, scale = quantize_fp8_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32
    assert tuple(scale.shape) == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    back = dequantize_fp8_blocks(q, scale, block)
    assert back.shape == w.shape and torch.isfinite(back).all()
    for ((bi, bj), original), (_, restored) in zip(_block_views(w, block), _block_views(back, block)):
        err = (restored - original).abs()
        top = original.abs().max()
        if top == 0:
            assert scale[bi, bj] == 1 and (err == 0).all()
            continue
        assert scale[bi, bj] == pytest.approx(float(top) / 448, rel=1e-6)
        assert err.max() <= top * 2 ** -3
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; below the smallest
        # normal (2^-6 before scaling) the step is 2^-9, half of it 2^-10
        assert (err <= original.abs() * 2 ** -4 + scale[bi, bj] * 2 ** -10).all()
        # the block's largest magnitude maps to 448 and comes back (up to the scale's rounding)
        assert restored.abs().max() == pytest.approx(float(top), rel=1e-6)


@pytest.mark.parametrize("block", BLOCKS)
def test_representable_values_come_back_exactly(block):
    g = torch.Generator().manual_seed(1)
    shape = (100, 70)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # 0x7F / 0xFF are NaN in e4m3fn; 0x38 is 1.0
    fp8 = codes.view(torch.float8_e4m3fn).float()
    nbo, nbi = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    scale = 2.0 ** torch.randint(-20, 0, (nbo, nbi), generator=g).float()
    for (bi, bj), view in _block_views(fp8, block):
        view[0, 0] = 448.0  # every block's maximum is the format's, so its scale is exact
    w = _dequantize_by_hand(fp8, scale, block)
    q, got_scale = quantize_fp8_blocks(w, block)
    assert torch.equal(got_scale, scale)
    assert torch.equal(q.float(), fp8)
    assert torch.equal(dequantize_fp8_blocks(q, got_scale, block), w)


def _dequantize_by_hand(fp8, scale, block):
    out = fp8.float().clone()
    for (bi, bj), view in _block_views(out, block):
        view.mul_(scale[bi, bj])
    return out


def _dequantized_copy(fp8_dir, dst):
    """The FP8 checkpoint rewritten unquantized (float32), dequantized block by block here."""
    shutil.copytree(fp8_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        plain = {n: (_dequantize_by_hand(t, tensors[n + "_scale_inv"], block) if t.dtype == torch.float8_e4m3fn else t)
                 for n, t in tensors.items() if not n.endswith("_scale_inv")}
        save_file(plain, f)
    return dst


def _fp8_ckpt(tmp_path, name="tiny", block=(32, 32), seed=0, **kw):
    return write_random_checkpoint(preset(name), tmp_path / f"fp8-{name}-{block[0]}x{block[1]}", seed=seed,
                                   fp8_block=block, progress=False, **kw)


def _all_tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


QUANTIZED = ["self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
             "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
             "mlp.experts.0.down_proj.weight", "mlp.experts.7.up_proj.weight", "mlp.shared_experts.gate_proj.weight"]
KEPT = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "input_layernorm.weight",
        "self_attn.kv_a_layernorm.weight", "mlp.gate.weight", "mlp.gate.e_score_correction_bias"]


def test_writer_quantizes_what_deepseek_quantizes(tmp_path):
    d = _fp8_ckpt(tmp_path, block=(16, 16))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization_config"] == dict(DEEPSEEK_V3_QUANT, weight_block_size=[16, 16])
    tensors = _all_tensors(d)
    fp8 = {n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 == {n[:-len("_scale_inv")] for n in tensors if n.endswith("_scale_inv")}
    for suffix in QUANTIZED:
        assert any(n.endswith(suffix) for n in fp8), suffix
    for suffix in KEPT:
        hits = [n for n in tensors if n.endswith(suffix)]
        assert hits and not any(n in fp8 for n in hits), suffix
    assert all(t.dtype == torch.float32 for n, t in tensors.items() if n.endswith("_scale_inv"))


def test_cli_writes_fp8(tmp_path):
    checkpoint.main(["--preset", "tiny", "--out", str(tmp_path / "c"), "--fp8-block", "32", "16"])
    assert ModelConfig.from_file(tmp_path / "c").quantization_config.weight_block_size == [32, 16]
    assert load_model(tmp_path / "c", progress=False) is not None


def _params(model):
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    return state


@pytest.mark.parametrize("name, block", [("tiny", (16, 16)), ("tiny", (32, 32)), ("tiny", (128, 128)),
                                         ("tiny-v4", (32, 16))])
def test_fp8_checkpoint_loads_as_its_dequantization(tmp_path, name, block):
    d = _fp8_ckpt(tmp_path, name, block)
    model = load_model(d, progress=False)
    assert model.cfg.quantization_config.weight_block_size == list(block)
    ref = load_model(_dequantized_copy(d, tmp_path / "plain"), progress=False)
    got, want = _params(model), _params(ref)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    # and the quantization did change the weights: a no-op dequantization would fail the above
    fp32 = load_model(write_random_checkpoint(preset(name), tmp_path / "fp32", progress=False), progress=False)
    assert not torch.equal(_params(fp32)["model.layers.0.self_attn.o_proj.weight"],
                           got["model.layers.0.self_attn.o_proj.weight"])


def _first_logits(ckpt, prompts, dtype="float32"):
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(dtype=dtype, block_size=4), progress=False)
    recorded = {}
    sample = engine.runner.sample

    def record(seqs, logits):
        for i, s in enumerate(seqs):
            recorded.setdefault(s.request_id, logits[i].float().clone())
        return sample(seqs, logits)
    engine.runner.sample = record
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return torch.stack([recorded[f"r{i}"] for i in range(len(prompts))])


def _rel_err(a, b):
    return float((a - b).norm() / b.norm())


PROMPTS = [[5, 17, 300, 42, 9], [100, 7, 7, 250, 3, 60, 480, 11, 2, 90, 33], list(range(20, 32))]


@pytest.mark.parametrize("name", ["tiny", "tiny-v4"])
def test_fp8_logits_are_close_to_the_unquantized_model(tmp_path, monkeypatch, name):
    fp32 = write_random_checkpoint(preset(name), tmp_path / "fp32", seed=3, progress=False)
    fp8 = _fp8_ckpt(tmp_path, name, (16, 16), seed=3)
    want = _first_logits(fp32, PROMPTS)
    assert want.abs().max() > 0.1  # random logits of a useful size, not near-zero noise
    err = _rel_err(_first_logits(fp8, PROMPTS), want)
    # 3 mantissa bits through four layers: about 5% (bf16 weights and activations: under 1%)
    assert 0 < err < 0.1, err

    # the check tells the scale's direction: dividing by it instead is far off
    monkeypatch.setattr(checkpoint, "dequantize_fp8_blocks",
                        lambda q, s, block: dequantize_fp8_blocks(q, 1 / s, block))
    assert not _rel_err(_first_logits(fp8, PROMPTS), want) < 0.5


def test_scale_in_another_shard(tmp_path):
    d = _fp8_ckpt(tmp_path, shard_bytes=40_000)
    assert len(list(d.glob("*.safetensors"))) > 2
    before = _params(load_model(d, progress=False))
    moved = shutil.copytree(d, tmp_path / "moved")
    scales = {}
    for f in sorted(moved.glob("*.safetensors")):
        tensors = load_file(f)
        scales.update({n: t for n, t in tensors.items() if n.endswith("_scale_inv")})
        save_file({n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}, f)
    # a file sorted before the weights: every scale is read from another shard than its weight's
    save_file(scales, moved / "aaa-scales.safetensors")
    tensors, total = iter_checkpoint(moved, [32, 32])
    names = [n for n, _ in tensors]
    assert total == len(names) == len(_all_tensors(d)) - len(scales)
    assert not any(n.endswith("_scale_inv") for n in names)
    after = _params(load_model(moved, progress=False))
    for n in before:
        assert torch.equal(before[n], after[n]), n


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    return _fp8_ckpt(tmp_path_factory.mktemp("fp8"))


def _edit(src, dst, change):
    """A copy of the checkpoint with its one shard's tensors changed by `change(dict)`."""
    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f)
    return dst


EXPERT = "model.layers.2.mlp.experts.5.gate_proj.weight"
ATTN = "model.layers.1.self_attn.kv_b_proj.weight"


def test_fp8_weight_without_scale(fp8_tiny, tmp_path):
    d = _edit(fp8_tiny, tmp_path / "ck", lambda t: t.pop(EXPERT + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"FP8 weight '{EXPERT}' has no scale '{EXPERT}_scale_inv'"):
        load_model(d, progress=False)


def test_scale_without_weight(fp8_tiny, tmp_path):
    d = _edit(fp8_tiny, tmp_path / "ck", lambda t: t.pop(ATTN))
    with pytest.raises(CheckpointError, match=rf"scale '{ATTN}_scale_inv' has no weight '{ATTN}'"):
        load_model(d, progress=False)


def test_scale_of_a_weight_that_is_not_fp8(fp8_tiny, tmp_path):
    d = _edit(fp8_tiny, tmp_path / "ck", lambda t: t.update({ATTN: t[ATTN].float()}))
    with pytest.raises(CheckpointError, match=rf"scale '{ATTN}_scale_inv' belongs to '{ATTN}', which is not"):
        load_model(d, progress=False)


@pytest.mark.parametrize("shape", [(4, 2), (4,), (2, 1)])
def test_scale_of_the_wrong_shape(fp8_tiny, tmp_path, shape):
    # kv_b_proj is [128, 32]: blocks of 32 x 32 give a [4, 1] grid
    d = _edit(fp8_tiny, tmp_path / "ck", lambda t: t.update({ATTN + "_scale_inv": torch.ones(shape)}))
    with pytest.raises(CheckpointError, match=rf"scale '{ATTN}_scale_inv' has shape .*expected \(4, 1\)"):
        load_model(d, progress=False)


def test_fp8_weights_without_quantization_config(fp8_tiny, tmp_path):
    d = shutil.copytree(fp8_tiny, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\..*' is FP8 but config.json has no quantization_"):
        load_model(d, progress=False)


def test_e5m2_weights_are_refused(fp8_tiny, tmp_path):
    d = _edit(fp8_tiny, tmp_path / "ck", lambda t: t.update({ATTN: t[ATTN].float().to(torch.float8_e5m2)}))
    with pytest.raises(CheckpointError, match=rf"'{ATTN}' is F8_E5M2"):
        load_model(d, progress=False)


def test_unquantized_weights_under_a_quantization_config_load(tiny_ckpt, tmp_path):
    # a checkpoint dequantized offline that kept its config.json's quantization_config
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, quantization_config=DEEPSEEK_V3_QUANT)))
    got, want = _params(load_model(d, progress=False)), _params(load_model(tiny_ckpt, progress=False))
    assert all(torch.equal(got[n], want[n]) for n in want)


def _with_quant(quant):
    return ModelConfig.from_dict(dict(preset("tiny").to_hf_dict(), quantization_config=quant))


def test_deepseek_quantization_configs_are_accepted():
    assert _with_quant(DEEPSEEK_V3_QUANT).quantization_config.weight_block_size == [128, 128]
    # DeepSeek-V3.1 and later add scale_fmt; transformers' FP8 config adds modules_to_not_convert
    cfg = _with_quant(dict(DEEPSEEK_V3_QUANT, scale_fmt="ue8m0", modules_to_not_convert=["lm_head"]))
    assert cfg.quantization_config.modules_to_not_convert == ["lm_head"]
    assert _with_quant(dict(DEEPSEEK_V3_QUANT, modules_to_not_convert=None)).quantization_config.fmt == "e4m3"
    assert preset("tiny").quantization_config is None


@pytest.mark.parametrize("quant, field", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "quant_method"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quant_method"),
    ({"quant_method": "compressed-tensors", "config_groups": {}, "format": "float-quantized"}, "quant_method"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}, "quant_method"),
    (dict(DEEPSEEK_V3_QUANT, fmt="e5m2"), "fmt"),
    (dict(DEEPSEEK_V3_QUANT, activation_scheme="static"), "activation_scheme"),
    ({"quant_method": "fp8"}, "weight_block_size"),
    (dict(DEEPSEEK_V3_QUANT, weight_block_size=[128]), "weight_block_size"),
    (dict(DEEPSEEK_V3_QUANT, weight_block_size=[128, 0]), "weight_block_size"),
    (dict(DEEPSEEK_V3_QUANT, weight_blocksize=[128, 128]), "weight_blocksize"),
])
def test_other_quantizations_are_refused_naming_the_field(tmp_path, quant, field):
    with pytest.raises(ConfigError, match=rf"quantization_config\.{field}: .*only DeepSeek's block FP8") as e:
        _with_quant(quant)
    # another method's own keys are not reported one by one
    assert "unknown key" not in str(e.value) or field == "weight_blocksize"
    # and a checkpoint carrying it fails when its config is read, before any weight
    (tmp_path / "config.json").write_text(json.dumps(dict(preset("tiny").to_hf_dict(), quantization_config=quant)))
    with pytest.raises(ConfigError, match=rf"quantization_config\.{field}"):
        load_model(tmp_path, progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("expert_dtype", ["model", "fp8_e4m3", "auto"])
def test_fp8_checkpoint_serves_on_the_gpu(tmp_path, expert_dtype):
    """Dequantized on the host, copied to the GPU (or, fp8_e4m3 and on the GPU auto, the experts
    kept as stored and computed by the FP8 kernels): the greedy tokens of the CPU engine."""
    ckpt = _fp8_ckpt(tmp_path, "tiny-v4", block=(128, 128))
    prompts = [list(range(4, 40)), list(range(100, 107))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        cfg = EngineConfig(device=device, block_size=4, warmup=False, expert_dtype=expert_dtype)
        engine = LLMEngine.from_pretrained(ckpt, cfg, progress=False)
        outs[device] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert engine.runner.model.model.embed_tokens.weight.is_cuda
    fp8 = engine.runner.model.moe_layers()[0].w13.dtype == torch.float8_e4m3fn
    assert fp8 == (expert_dtype != "model")
    assert outs["cuda"] == outs["cpu"]


def test_layers_past_the_model_are_not_read(tmp_path, monkeypatch):
    """An MTP-style layer after the main ones (DeepSeek-V3's layer 61) is left unread: not
    dequantized, not yielded, not counted, and the model loads as without it."""
    d = write_random_checkpoint(preset("tiny", num_hidden_layers=5), tmp_path / "with-mtp", fp8_block=(32, 32),
                                progress=False)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    stored = _all_tensors(d)
    extra = [n for n in stored if n.startswith("model.layers.4.")]
    fp8_kept = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn and n not in extra]
    assert extra and any(stored[n].dtype == torch.float8_e4m3fn for n in extra)
    calls = []
    monkeypatch.setattr(checkpoint, "dequantize_fp8_blocks",
                        lambda q, s, block: calls.append(q.shape) or dequantize_fp8_blocks(q, s, block))
    tensors, total = iter_checkpoint(d, [32, 32], num_layers=4)
    names = [n for n, _ in tensors]
    assert not any(n.startswith("model.layers.4.") for n in names)
    assert total == len(names) == len(stored) - len(extra) - sum(n.endswith("_scale_inv") for n in stored
                                                                    if n not in extra)
    assert len(calls) == len(fp8_kept)
    assert isinstance(load_model(d, progress=False), checkpoint.DeepseekForCausalLM)


@pytest.mark.parametrize("name, block", [("tiny", (16, 16)), ("tiny-v4", (32, 16))])
def test_fp8_experts_load_as_stored(tmp_path, name, block):
    """With fp8_experts the routed experts keep the checkpoint's own bytes and scales (never
    dequantized); everything else loads dequantized as before, and the engine serves what the
    plain (all-dequantized) load serves."""
    d = _fp8_ckpt(tmp_path, name, block)
    stored = {}
    for f in sorted(d.glob("*.safetensors")):
        stored.update(load_file(f))
    model = load_model(d, progress=False, fp8_experts=True)
    plain = load_model(d, progress=False)
    inter = model.cfg.moe_intermediate_size
    for moe, ref in zip(model.moe_layers(), plain.moe_layers()):
        assert moe.fp8_block == block and moe.w13.dtype == torch.float8_e4m3fn
        index = [i for i, l in enumerate(model.model.layers) if l.mlp is moe][0]
        for e in (0, model.cfg.n_routed_experts - 1):
            prefix = f"model.layers.{index}.mlp.experts.{e}"
            gate, up = stored[f"{prefix}.gate_proj.weight"], stored[f"{prefix}.up_proj.weight"]
            assert torch.equal(moe.w13.data[e, :inter].view(torch.uint8), gate.view(torch.uint8))
            assert torch.equal(moe.w13.data[e, inter:].view(torch.uint8), up.view(torch.uint8))
            assert torch.equal(moe.w2.data[e].view(torch.uint8), stored[f"{prefix}.down_proj.weight"].view(torch.uint8))
            half = moe.scales.w13.shape[1] // 2
            assert torch.equal(moe.scales.w13[e, :half], stored[f"{prefix}.gate_proj.weight_scale_inv"])
            assert torch.equal(moe.scales.w13[e, half:], stored[f"{prefix}.up_proj.weight_scale_inv"])
            assert torch.equal(moe.scales.w2[e], stored[f"{prefix}.down_proj.weight_scale_inv"])
        w13, w2 = dequantize_experts(moe.w13.data, moe.w2.data, moe.scales)
        assert torch.equal(w13, ref.w13.data) and torch.equal(w2, ref.w2.data)
    prompts = [[5, 17, 300, 42, 9], list(range(20, 32))]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = {}
    for dt in ("fp8_e4m3", "auto"):  # auto: 16-bit on the CPU
        engine = LLMEngine.from_pretrained(d, EngineConfig(block_size=4, expert_dtype=dt, fuse_shared_experts=False),
                                           progress=False)
        assert (engine.runner.model.moe_layers()[0].w13.dtype == torch.float8_e4m3fn) == (dt == "fp8_e4m3")
        outs[dt] = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    assert outs["fp8_e4m3"] == outs["auto"]
