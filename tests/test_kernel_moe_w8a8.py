"""FP8 activations beside block-FP8 expert weights (act_fp8: per token per 128 columns, the
products on FP8 tensor cores) in the fused MoE kernels, against their reference."""
import pytest
import torch

from kernel_devices import DEVICES

pytest.importorskip("triton")

from wideep_kernels import moe_gemm  # noqa: E402
from wideep_kernels.fp8_blocks import act_group, fake_quantize_act, quantize_act_groups, quantize_experts  # noqa: E402
from wideep_kernels.moe_gemm import (MoEGemmConfig, fused_experts, fused_experts_reference,  # noqa: E402
                              fused_experts_triton, pick_config)
from test_kernel_moe_fp8 import block_varied_weights, routing, to, with_shared_slot  # noqa: E402

# fp32 activations: the kernels' products of e4m3 values are exact; what is left is the order of
# the fp32 sums (and on the GPU the FP8 tensor cores' accumulation within a k step). 16-bit
# activations: a SwiGLU output rounded the other way can move its group's scale, and so every
# value of the group by up to half an e4m3 step.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


def group_varied_rows(num_tokens, hidden, group, seed):
    """Rows whose column groups differ in magnitude by up to 1000x: one scale a row (instead of a
    group) would flush the small groups to e4m3's subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    mag = torch.exp(torch.empty(num_tokens, -(-hidden // group)).uniform_(-3.5, 3.5, generator=gen))
    return x * mag.repeat_interleave(group, 1)[:, :hidden]


def test_quantize_act_groups():
    x = group_varied_rows(5, 80, 32, seed=1)  # 80 columns: the last group is partial
    x[2] = 0.0
    q, scale = quantize_act_groups(x, 32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, 3)
    # each group's largest magnitude maps to 448
    assert torch.equal(q[[0, 1, 3, 4], :32].float().abs().amax(1), torch.full((4,), 448.0))
    assert (q[2].float() == 0).all() and torch.isfinite(scale).all()  # a zero row stays zero
    back = fake_quantize_act(x, 32)
    # 3 mantissa bits, each group to its own scale: within 1/16 of every value, small groups included
    assert ((back - x).abs() <= x.abs() / 16 + 2.0 ** -9 * scale.repeat_interleave(32, 1)[:, :80]).all()
    # a single scale a row would lose a group 1e6 times smaller than another to e4m3's subnormals
    gen = torch.Generator().manual_seed(2)
    small = torch.randn(4, 48, generator=gen)
    wide = torch.cat([1e6 * torch.randn(4, 32, generator=gen), small], 1)
    assert rel_err(fake_quantize_act(wide, 80)[:, 32:], small) > 0.5
    assert rel_err(fake_quantize_act(wide, 32)[:, 32:], small) < 0.05
    assert act_group((128, 128)) == 128 and act_group((128, 64)) == 64 and act_group((64, 256)) == 128


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,block", [(1, (32, 32)), (7, (32, 32)), (33, (16, 32))])
def test_fp8_activations_match_their_reference(device, dtype, num_tokens, block):
    hidden, inter, num_slots, topk = 64, 48, 6, 2
    q13, q2, scales = to(device, *quantize_experts(*block_varied_weights(num_slots, hidden, inter, block), block))
    x = group_varied_rows(num_tokens, hidden, act_group(block), seed=3).to(device, dtype)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < TOLERANCE[dtype]
    # the activations really were quantized: 16-bit ones give another result, close by
    a16 = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert 2 * TOLERANCE[torch.float32] < rel_err(want, a16) < 0.15
    assert rel_err(fused_experts(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True), got) \
        < TOLERANCE[dtype]


# The GPU's wgmma tiles (rows of 64) sum a k step's FP8 products on the tensor cores in about 14
# bits (DeepSeek-V3's report), promoted to fp32 once a step by default (FP8_PRECISE_ACC 0). The
# chunk-tile test's k steps mix weight blocks up to 100x apart, whose small products lose most of
# those bits: 1.3e-2 on an H200, 5.7e-4 when promoted every 32 k. A wrong scale is off by O(1).
WGMMA_FP8_SUMS = 3e-2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("pair_rows", [False, True])  # fp32 atomics or a row a pair
@pytest.mark.parametrize("precise_acc", [0, 32])
def test_fp8_activation_chunk_tiles(device, block_m, pair_rows, precise_acc, monkeypatch):
    """Many rows a slot, prompt-chunk row tiles among them: k steps of one activation group
    whatever the configured BLOCK_K, inside weight blocks wider than the group."""
    if precise_acc and device != "cuda":
        pytest.skip("the interpreter's FP8 products are summed in fp32 at any promotion interval")
    monkeypatch.setattr(moe_gemm, "FP8_PRECISE_ACC", precise_acc)
    hidden, inter, num_slots, topk, num_tokens = 256, 128, 2, 2, 40
    block = (128, 256)  # group 128: two k steps a weight block
    q13, q2, scales = to(device, *quantize_experts(*block_varied_weights(num_slots, hidden, inter, (32, 32)), block))
    x = group_varied_rows(num_tokens, hidden, 128, seed=4).to(device, torch.float32)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    config = MoEGemmConfig(block_m, (32, 64, 4, 2), (32, 32, 4, 2), pair_rows)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, config=config, scales=scales, act_fp8=True)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    wgmma_sums = device == "cuda" and block_m >= 64 and not precise_acc
    assert rel_err(got, want) < (WGMMA_FP8_SUMS if wgmma_sums else TOLERANCE[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_activations_with_the_shared_expert_slot(device):
    hidden, inter, num_slots, topk, num_tokens = 64, 32, 4, 2, 5
    block = (16, 32)
    q13, q2, scales, shared = with_shared_slot(device, num_slots, hidden, inter, block)
    x = group_varied_rows(num_tokens, hidden, 32, seed=6).to(device, torch.float32)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, shared=shared, scales=scales, act_fp8=True)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, shared=shared, scales=scales, act_fp8=True)
    assert rel_err(got, want) < TOLERANCE[torch.float32]
    routed = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    assert rel_err(got, routed) > 0.05  # the shared part was added


def test_fp8_activations_need_fp8_weights():
    x, w13, w2 = torch.randn(1, 64), torch.randn(2, 64, 64), torch.randn(2, 64, 32)
    slot_of, weight_of = torch.tensor([0, 1]), torch.ones(2)
    with pytest.raises(ValueError, match="act_fp8"):
        fused_experts(x, w13, w2, None, slot_of, weight_of, act_fp8=True)
    with pytest.raises(ValueError, match="act_fp8"):
        fused_experts_reference(x, w13, w2, None, slot_of, weight_of, act_fp8=True)
    q13, q2, scales = quantize_experts(w13, w2, (16, 16))  # an FP8 product takes 32 k a step
    with pytest.raises(ValueError, match="at least 32 columns"):
        fused_experts(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    # decode row tiles stay the 16-bit activations' (the router lays out one token's pairs for them)
    for pairs in (6, 64, 1024):
        assert pick_config(pairs, 64, torch.float8_e4m3fn, True).block_m == \
            pick_config(pairs, 64, torch.float8_e4m3fn).block_m


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 512])
def test_fp8_activations_on_gpu_built_in_tiles(num_tokens):
    """The built-in tiles (pick_config) on the bench model's shape, decode to prompt chunks."""
    hidden, inter, num_slots, topk = 2048, 768, 64, 6
    q13, q2, scales = to("cuda", *quantize_experts(*block_varied_weights(num_slots, hidden, inter, (128, 128)),
                                                   (128, 128)))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, "cuda")
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    assert rel_err(got, want) < TOLERANCE[torch.bfloat16]
    a16 = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert rel_err(got, a16) < 0.15
