"""Block-FP8 expert weights (wideep_kernels/fp8_blocks.py's layout) in the fused MoE kernels
(wideep_kernels/moe_gemm.py): against the reference on the dequantized weights."""
import pytest
import torch

from kernel_devices import DEVICES

pytest.importorskip("triton")

from wideep_kernels.fp8_blocks import ExpertScales, dequantize_experts, quantize_experts  # noqa: E402
from wideep_kernels.moe_gemm import MoEGemmConfig, fused_experts, fused_experts_reference, fused_experts_triton  # noqa: E402

# Relative to the whole output's norm: blocks of very different magnitudes make large outputs,
# which 16-bit activations round in absolute steps of their own size.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_near(got, want, dtype):
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def block_varied_weights(num_slots, hidden, inter, block, seed=0):
    """Weights whose blocks differ in magnitude by up to 100x, so a kernel reading another
    block's scale (or none) is far off."""
    gen = torch.Generator().manual_seed(seed)

    def one(rows, cols):
        w = torch.randn(num_slots, rows, cols, generator=gen) * cols ** -0.5
        rb, cb = -(-rows // block[0]), -(-cols // block[1])
        mag = torch.exp(torch.empty(num_slots, rb, cb).uniform_(-2.3, 2.3, generator=gen))
        return w * mag.repeat_interleave(block[0], 1)[:, :rows].repeat_interleave(block[1], 2)[:, :, :cols]

    return one(2 * inter, hidden), one(hidden, inter)


def routing(num_tokens, topk, num_slots, device, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    slot_of = torch.rand(num_tokens, num_slots, generator=gen).topk(topk, dim=1).indices.flatten()
    weight_of = torch.rand(num_tokens * topk, generator=gen) + 0.1
    return slot_of.to(device), weight_of.to(device)


def to(device, q13, q2, scales):
    return q13.to(device), q2.to(device), ExpertScales(scales.w13.to(device), scales.w2.to(device), scales.block)


def with_shared_slot(device, num_slots, hidden, inter, block):
    """FP8 routed experts and one more, as the shared expert with its own scales."""
    q13, q2, scales = quantize_experts(*block_varied_weights(num_slots + 1, hidden, inter, block, seed=5), block)
    shared = (q13[num_slots].to(device), q2[num_slots].to(device),
              ExpertScales(scales.w13[num_slots].to(device), scales.w2[num_slots].to(device), block))
    return (*to(device, q13[:num_slots], q2[:num_slots],
                ExpertScales(scales.w13[:num_slots], scales.w2[:num_slots], block)), shared)


def test_quantize_experts_layout_and_round_trip():
    # inter 24 in row blocks of 16: the gate's second block is partial and must not take up rows
    w13, w2 = block_varied_weights(3, 64, 24, (16, 32))
    q13, q2, scales = quantize_experts(w13, w2, (16, 32))
    assert q13.dtype == q2.dtype == torch.float8_e4m3fn
    assert q13.shape == w13.shape and q2.shape == w2.shape
    assert scales.w13.shape == (3, 4, 2) and scales.w2.shape == (3, 4, 1)
    back13, back2 = dequantize_experts(q13, q2, scales)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value, plus the block's smallest step
    for back, w in ((back13, w13), (back2, w2)):
        assert ((back - w).abs() <= w.abs() / 16 + 1e-3 * w.abs().max()).all()
    # the up projection's blocks come from its own rows alone
    up_only, _, up_scales = quantize_experts(torch.cat([torch.zeros_like(w13[:, :24]), w13[:, 24:]], 1), w2, (16, 32))
    assert torch.equal(up_scales.w13[:, 2:], scales.w13[:, 2:]) and torch.equal(up_only[:, 24:], q13[:, 24:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,block", [(1, (16, 16)), (7, (32, 32)), (33, (16, 32))])
def test_fp8_experts_match_the_dequantized_reference(device, dtype, num_tokens, block):
    hidden, inter, num_slots, topk = 64, 48, 6, 2
    q13, q2, scales = to(device, *quantize_experts(*block_varied_weights(num_slots, hidden, inter, block), block))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, scales=scales)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert_near(got.float(), want.float(), dtype)
    # the reference is the plain computation on the dequantized weights
    w13, w2 = dequantize_experts(q13, q2, scales)
    plain = fused_experts_reference(x.float(), w13, w2, None, slot_of, weight_of)
    assert_near(want.float(), plain, dtype)
    # the scales matter: a routed slot's largest gate block scale doubled moves the result
    bumped = ExpertScales(scales.w13.clone(), scales.w2, block)
    slot = int(slot_of[0])
    bumped.w13[slot].view(-1)[bumped.w13[slot].argmax()] *= 2
    moved = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, scales=bumped)
    assert (moved.float() - got.float()).norm() > 3 * TOLERANCE[dtype] * got.float().norm()
    # the dispatcher takes the same path (fp32 atomics: the last bits may differ)
    assert_near(fused_experts(x, q13, q2, None, slot_of, weight_of, scales=scales).float(),
                               got.float(), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("pair_rows", [False, True])  # fp32 atomics or a row a pair
def test_fp8_prompt_chunk_tiles(device, block_m, pair_rows):
    """Many rows per slot: BLOCK_K 64 and 32 inside blocks of 128 columns; rows of 64 (prompt
    chunks; 128 past 128 rows a slot) dequantize the weight tile instead of scaling the products."""
    hidden, inter, num_slots, topk, num_tokens = 128, 64, 2, 2, 40
    block = (128, 128)
    q13, q2, scales = to(device, *quantize_experts(*block_varied_weights(num_slots, hidden, inter, (32, 32)), block))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    config = MoEGemmConfig(block_m, (32, 64, 4, 2), (32, 32, 4, 2), pair_rows)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, config=config, scales=scales)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert_near(got.float(), want.float(), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_shared_expert_as_one_more_slot(device):
    hidden, inter, num_slots, topk, num_tokens = 64, 32, 4, 2, 5
    block = (16, 32)
    q13, q2, scales, shared = with_shared_slot(device, num_slots, hidden, inter, block)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(6)).to(device, torch.bfloat16)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, shared=shared, scales=scales)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, shared=shared, scales=scales)
    assert_near(got.float(), want.float(), torch.bfloat16)
    routed = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert (got.float() - routed.float()).abs().max() > 0.05  # the shared part was added
    other_blocks = quantize_experts(*dequantize_experts(*shared), (32, 32))
    with pytest.raises(ValueError, match="blocks must match"):
        fused_experts_triton(x, q13, q2, None, slot_of, weight_of, shared=other_blocks, scales=scales)


def test_bad_fp8_expert_arguments():
    hidden, inter, block = 64, 32, (16, 32)
    q13, q2, scales = quantize_experts(*block_varied_weights(2, hidden, inter, block), block)
    x = torch.randn(1, hidden)
    slot_of, weight_of = torch.tensor([0, 1]), torch.ones(2)
    with pytest.raises(ValueError, match="need their scales"):
        fused_experts(x, q13, q2, None, slot_of, weight_of)
    with pytest.raises(ValueError, match="do not match"):
        fused_experts(x, q13, q2, None, slot_of, weight_of, scales=scales._replace(w2=scales.w2[:, :2]))
    with pytest.raises(ValueError, match="power of two"):
        fused_experts(x, q13, q2, None, slot_of, weight_of, scales=scales._replace(block=(16, 24)))
    with pytest.raises(ValueError, match="float8_e4m3fn weights"):
        fused_experts(x, q13.float(), q2.float(), None, slot_of, weight_of, scales=scales)


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_tiles_fall_back_to_scaled_products_when_the_dequantizing_build_fails(device, monkeypatch, caplog):
    """Should the weight-dequantizing variant of the chunk tiles not build on some GPU, the
    products-scaled one (the decode tiles' method) computes the same result instead, with a warning."""
    import wideep_kernels
    from wideep_kernels import moe_gemm
    monkeypatch.setattr(wideep_kernels, "_unusable", set())
    real = moe_gemm._jit

    class Unbuildable:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                if kw.get("DEQUANT_TILE"):
                    raise RuntimeError("no build for this GPU")
                return self.kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(moe_gemm, "_jit", lambda fn, *plain: Unbuildable(real(fn, *plain)))
    hidden, inter, num_slots, topk, num_tokens = 64, 32, 2, 2, 40
    q13, q2, scales = to(device, *quantize_experts(*block_varied_weights(num_slots, hidden, inter, (16, 16)), (16, 16)))
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(8)).to(device, torch.bfloat16)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, device)
    config = MoEGemmConfig(64, (32, 16, 4, 2), (32, 16, 4, 2))
    got = fused_experts_triton(x, q13, q2, None, slot_of, weight_of, config=config, scales=scales)
    want = fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales)
    assert_near(got, want, torch.bfloat16)
    assert "moe_fp8_dequant_tile" in wideep_kernels._unusable and "no build for this GPU" in caplog.text
