"""Block-FP8 routed experts in the engine (EngineConfig.expert_dtype = "fp8_e4m3")."""
import pytest
import torch
from pydantic import ValidationError

from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.moe import MoE
from engine.sampling import SamplingParams
from wideep_kernels.fp8_blocks import dequantize_experts

from kernel_devices import INTERPRETING

needs_interpreter = pytest.mark.skipif(not INTERPRETING, reason="CPU runs Triton only under TRITON_INTERPRET=1")

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _moe_pair(block=(16, 16), seed=0):
    """A MoE layer quantized to FP8 and a copy holding its dequantized weights."""
    cfg = preset("tiny")
    torch.manual_seed(seed)
    fp8 = MoE(cfg)
    for p in fp8.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fp8.gate.e_score_correction_bias.normal_(std=0.1)
    dense = MoE(cfg)
    dense.load_state_dict(fp8.state_dict())
    fp8.quantize_experts(block)
    w13, w2 = dequantize_experts(fp8.w13.data, fp8.w2.data, fp8.scales)
    dense.w13.data.copy_(w13)
    dense.w2.data.copy_(w2)
    for m in (fp8, dense):
        m.fuse_shared = False
    return fp8, dense


def test_quantized_layer_stores_one_byte_a_weight_and_moves_scales_with_slots():
    fp8, dense = _moe_pair()
    assert fp8.w13.dtype == fp8.w2.dtype == torch.float8_e4m3fn and not fp8.w13.requires_grad
    # tiny: hidden 64 (4 column blocks of 16), moe_intermediate 32 (2 row blocks each for gate and up)
    assert fp8.scales.w13.shape == (fp8.w13.shape[0], 4, 4) and fp8.scales.w2.shape == (fp8.w2.shape[0], 4, 2)
    tensors = fp8.slot_tensors()
    assert [t.shape[0] for t in tensors] == [fp8.w13.shape[0]] * 4
    assert tensors[2].data_ptr() == fp8.scales.w13.data_ptr()  # what the balancer copies is what is read
    assert len(dense.slot_tensors()) == 2
    with pytest.raises(ValueError, match="already FP8"):
        fp8.quantize_experts((16, 16))


@needs_interpreter
@pytest.mark.parametrize("gemm", ["auto", "grouped_mm"])
@pytest.mark.parametrize("tokens", [1, 9])
@torch.no_grad()
def test_quantized_layer_computes_its_dequantized_weights(gemm, tokens, monkeypatch):
    """The fused kernels (auto: interpreted) and the dense fallback (grouped_mm on CPU: the
    per-slot loop on dequantized weights) against the same layer holding the dequantized weights."""
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    fp8, dense = _moe_pair()
    fp8.gemm = dense.gemm = gemm
    x = torch.randn(tokens, fp8.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert fp8._fused_ok(x) == (gemm == "auto")
    got, want = fp8(x).float(), dense(x).float()
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert torch.equal(fp8.slot_load, dense.slot_load) and int(fp8.slot_load.sum()) > 0


@needs_interpreter
@pytest.mark.parametrize("tokens", [1, 9])
@torch.no_grad()
def test_fp8_activations_in_the_kernels_and_the_fallback(tokens, monkeypatch):
    """act_fp8 (EngineConfig.expert_activations): the fused kernels and the per-slot fallback
    multiply the same quantized activations, and those are not the 16-bit ones."""
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    fp8, _ = _moe_pair(block=(16, 32))
    x = torch.randn(tokens, fp8.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    a16 = fp8(x).float()
    fp8.activations = "fp8_e4m3"
    fused = fp8(x).float()
    fp8.gemm = "grouped_mm"  # on CPU: the loop over slots on the dequantized weights
    assert not fp8._fused_ok(x)
    fallback = fp8(x).float()
    assert float((fused - fallback).norm() / fallback.norm()) < 1e-4
    assert 1e-3 < float((fused - a16).norm() / a16.norm()) < 0.1


@needs_interpreter
@torch.no_grad()
def test_fused_shared_expert_reads_an_fp8_copy(monkeypatch):
    """With the shared expert fused as one more slot its FP8 copy is computed: near the separate
    16-bit shared MLP (within FP8's rounding), and not identical to it."""
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    fp8, _ = _moe_pair()
    x = torch.randn(5, fp8.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    separate = fp8(x).float()
    fp8.fuse_shared = True
    shared = fp8._shared_slot(x)
    assert shared is not None and shared[0].dtype == torch.float8_e4m3fn
    fused = fp8(x).float()
    err = float((fused - separate).norm() / separate.norm())
    assert 0 < err < 0.05, err


def _engine(ckpt, **kw):
    return LLMEngine.from_pretrained(ckpt, EngineConfig(block_size=4, **kw), progress=False)


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in (11, 3, 25)]


def test_fp8_engine_serves_the_dequantized_model(tiny_ckpt):
    """Greedy tokens (prefill, chunks and decode) of the FP8-expert engine are those of the same
    model holding the dequantized expert weights, and no KV block is leaked."""
    fp8 = _engine(tiny_ckpt, expert_dtype="fp8_e4m3", fuse_shared_experts=False)
    dense = _engine(tiny_ckpt, fuse_shared_experts=False)
    for q, d in zip(fp8.runner.model.moe_layers(), dense.runner.model.moe_layers()):
        assert q.w13.dtype == torch.float8_e4m3fn and q.fp8_block == (128, 128)  # tiny has no checkpoint block
        w13, w2 = dequantize_experts(q.w13.data, q.w2.data, q.scales)
        d.w13.data.copy_(w13)
        d.w2.data.copy_(w2)
    prompts = _prompts()
    got = [o.output_token_ids for o in fp8.generate(prompts, GREEDY)]
    want = [o.output_token_ids for o in dense.generate(prompts, GREEDY)]
    assert got == want
    assert fp8.scheduler.blocks.num_used_blocks == 0
    # and the quantization changed something: the 16-bit weights differ from the dequantized ones
    plain = _engine(tiny_ckpt)
    q, p = fp8.runner.model.moe_layers()[0], plain.runner.model.moe_layers()[0]
    assert not torch.equal(dequantize_experts(q.w13.data, q.w2.data, q.scales)[0], p.w13.data.float())


def test_fp8_activations_engine(tiny_ckpt):
    """The engine with FP8 activations serves and frees its blocks; its MoE layers (the same FP8
    weights) give outputs near, not equal to, those with 16-bit activations."""
    engines = [_engine(tiny_ckpt, expert_dtype="fp8_e4m3", expert_activations=a) for a in ("model", "fp8_e4m3")]
    assert [m.activations for e in engines for m in e.runner.model.moe_layers()[:1]] == ["model", "fp8_e4m3"]
    outs = [e.generate(_prompts(), GREEDY) for e in engines]
    assert all(len(o.output_token_ids) == GREEDY.max_tokens for o in outs[1])
    assert engines[1].scheduler.blocks.num_used_blocks == 0
    layers = [e.runner.model.moe_layers()[0] for e in engines]
    assert torch.equal(layers[0].w13, layers[1].w13)
    x = torch.randn(6, layers[0].cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a16, a8 = (m(x).float() for m in layers)
    err = float((a8 - a16).norm() / a16.norm())
    assert 0 < err < 0.1, err


def test_bad_expert_dtype_names_the_field():
    with pytest.raises(ValidationError, match="expert_dtype"):
        EngineConfig(expert_dtype="fp4")
    with pytest.raises(ValidationError, match="expert_activations"):
        EngineConfig(expert_dtype="model", expert_activations="fp8_e4m3")  # FP8 activations need FP8 weights
    with pytest.raises(ValidationError, match="expert_activations"):
        EngineConfig(expert_dtype="fp8_e4m3", expert_activations="int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("activations", ["auto", "fp8_e4m3"])
def test_fp8_experts_on_gpu_graphs_match_eager(tiny_v4_ckpt, activations):
    """bf16 on the GPU: decode steps replayed from CUDA graphs (the FP8 shared slot fused, the
    router laying out one token's pairs) give the eager FP8 engine's tokens."""
    kw = dict(device="cuda", dtype="bfloat16", expert_dtype="fp8_e4m3", expert_activations=activations,
              warmup=False)
    prompts = _prompts(seed=3)
    graphs = _engine(tiny_v4_ckpt, **kw)
    eager = _engine(tiny_v4_ckpt, cuda_graphs=False, **kw)
    got = [o.output_token_ids for o in graphs.generate(prompts, GREEDY)]
    assert got == [o.output_token_ids for o in eager.generate(prompts, GREEDY)]
    assert graphs.runner.graphs.graphs, "no decode step was replayed from a graph"
    one = [o.output_token_ids for o in graphs.generate(prompts[:1], GREEDY)]
    assert one == got[:1]


def test_fp8_experts_refuse_the_grouped_gemm_and_odd_checkpoint_blocks():
    from engine.config import ConfigError, FP8Quantization
    from engine.moe import expert_fp8_block
    with pytest.raises(ValidationError, match="expert_dtype 'fp8_e4m3' is computed by the fused Triton kernels"):
        EngineConfig(expert_dtype="fp8_e4m3", moe_gemm="grouped_mm")
    cfg = preset("tiny")
    assert expert_fp8_block(cfg) == (128, 128)
    odd = cfg.model_copy(update={"quantization_config": FP8Quantization(quant_method="fp8", weight_block_size=[128, 96])})
    with pytest.raises(ConfigError, match=r"weight_block_size \[128, 96\]"):
        expert_fp8_block(odd)
    ok = cfg.model_copy(update={"quantization_config": FP8Quantization(quant_method="fp8", weight_block_size=[64, 32])})
    assert expert_fp8_block(ok) == (64, 32)


def test_fp8_activations_refuse_blocks_narrower_than_an_fp8_product():
    from engine.config import ConfigError, FP8Quantization
    from engine.model import DeepseekForCausalLM
    cfg = preset("tiny").model_copy(
        update={"quantization_config": FP8Quantization(quant_method="fp8", weight_block_size=[128, 16])})
    model = DeepseekForCausalLM(cfg, device="cpu")
    with pytest.raises(ConfigError, match=r"expert_activations 'fp8_e4m3'.*\[128, 16\]"):
        LLMEngine(model, None, EngineConfig(block_size=4, expert_dtype="fp8_e4m3", expert_activations="fp8_e4m3"))


def _fp8_cfg(block=(128, 128)):
    from engine.config import FP8Quantization
    return preset("tiny").model_copy(
        update={"quantization_config": FP8Quantization(quant_method="fp8", weight_block_size=list(block))})


def test_auto_expert_dtype_keeps_an_fp8_checkpoint_fp8_on_a_gpu():
    """expert_dtype 'auto': DeepSeek's FP8 checkpoints keep their experts FP8 on a GPU (as vLLM and
    SGLang serve them); elsewhere, with the grouped GEMM, with blocks the kernels cannot step
    through, or for an unquantized checkpoint, the model dtype."""
    fp8, plain = _fp8_cfg(), preset("tiny")
    gpu = dict(device="cuda", dtype="bfloat16")
    assert EngineConfig(**gpu).fp8_experts(fp8)
    assert EngineConfig(device="cuda:1").fp8_experts(fp8)
    assert not EngineConfig(**gpu).fp8_experts(plain)
    assert not EngineConfig().fp8_experts(fp8)  # CPU
    assert not EngineConfig(moe_gemm="grouped_mm", **gpu).fp8_experts(fp8)
    assert not EngineConfig(**gpu).fp8_experts(_fp8_cfg((128, 96)))
    assert not EngineConfig(expert_dtype="model", **gpu).fp8_experts(fp8)
    assert EngineConfig(expert_dtype="fp8_e4m3").fp8_experts(plain)  # quantized at start, any device


def test_expert_activations_resolve_against_the_experts():
    from engine.config import ConfigError
    from engine.model_runner import expert_activations
    cfg = lambda a, d="auto": EngineConfig(expert_dtype=d, expert_activations=a)  # noqa: E731
    assert expert_activations(cfg("auto"), (128, 128)) == "auto"
    assert expert_activations(cfg("fp8_e4m3"), (128, 128)) == "fp8_e4m3"
    assert expert_activations(cfg("model"), (128, 128)) == "model"
    assert expert_activations(cfg("auto"), None) == "model"  # 16-bit experts
    assert expert_activations(cfg("auto"), (128, 16)) == "model"  # narrower than one FP8 product's k
    with pytest.raises(ConfigError, match="expert_activations 'fp8_e4m3'.*expert_dtype 'fp8_e4m3'"):
        expert_activations(cfg("fp8_e4m3"), None)  # auto kept this checkpoint's experts 16-bit


@torch.no_grad()
def test_auto_activations_quantize_where_an_expert_gets_many_rows():
    """expert_activations 'auto': FP8 inputs where the pairs take row tiles of 32 or more (17 rows
    a slot), 16-bit ones in small decode batches; each equal to the layer in that mode."""
    from wideep_kernels.moe_gemm import act_fp8_pays
    fp8, _ = _moe_pair(block=(16, 32))
    slots = fp8.w13.shape[0]
    k = fp8.cfg.num_experts_per_tok
    assert not act_fp8_pays(16 * slots, slots) and act_fp8_pays(17 * slots, slots)
    fp8.activations = "auto"
    assert not fp8.act_fp8(k) and fp8.act_fp8(40 * slots)
    gen = torch.Generator().manual_seed(2)
    for tokens, quantized in ((3, False), (40 * slots // k, True)):
        x = torch.randn(tokens, fp8.cfg.hidden_size, generator=gen)
        fp8.activations = "auto"
        got = fp8(x)
        fp8.activations = "fp8_e4m3" if quantized else "model"
        assert torch.equal(got, fp8(x))
        fp8.activations = "model" if quantized else "fp8_e4m3"
        assert not torch.equal(got, fp8(x))
    _, dense = _moe_pair(block=(16, 32))
    dense.activations = "fp8_e4m3"
    assert not dense.act_fp8(40 * slots)  # 16-bit experts: nothing to quantize beside


def test_fp8_activations_with_16_bit_experts_fail_at_start():
    from engine.config import ConfigError
    from engine.model import DeepseekForCausalLM
    model = DeepseekForCausalLM(_fp8_cfg(), device="cpu")  # an FP8 checkpoint's config; CPU: 'auto' keeps 16-bit
    with pytest.raises(ConfigError, match="expert_activations 'fp8_e4m3'"):
        LLMEngine(model, None, EngineConfig(block_size=4, expert_activations="fp8_e4m3"))
