"""Fused MoE grouped GEMM (wideep_kernels/moe_gemm.py): the Triton kernels against the per-slot reference."""
from pathlib import Path

import pytest
import torch

from kernel_devices import DEVICES, IMPORTED_TOO_EARLY, poison_empty

pytest.importorskip("triton")

from wideep_kernels import moe_gemm  # noqa: E402
from wideep_kernels.moe_align import align_pairs_reference, align_pairs_triton, max_tiles  # noqa: E402
from wideep_kernels.moe_gemm import (  # noqa: E402
    MoEGemmConfig, fused_experts, fused_experts_reference, fused_experts_triton,
)

TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_weights(num_slots, hidden, inter, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_slots, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(num_slots, hidden, inter, generator=gen) * inter ** -0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def make_routing(num_tokens, topk, allowed_slots, device, seed=0):
    """Token-major pairs as the engine builds them: each token picks topk distinct allowed slots."""
    gen = torch.Generator().manual_seed(seed + 1)
    allowed = torch.tensor(allowed_slots)
    choice = torch.rand(num_tokens, len(allowed_slots), generator=gen).topk(topk, dim=1).indices
    slot_of = allowed[choice].flatten()
    token_of = torch.arange(num_tokens).repeat_interleave(topk)
    weight_of = torch.rand(num_tokens * topk, generator=gen) + 0.1
    return token_of.to(device), slot_of.to(device), weight_of.to(device)


def check(x, w13, w2, token_of, slot_of, weight_of, config=None):
    got = fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of, config=config)
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[x.dtype])
    return got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_matches_reference(device, dtype, num_tokens):
    hidden, inter, num_slots, topk = 64, 32, 8, 2
    w13, w2 = make_weights(num_slots, hidden, inter, dtype, device)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    # Slots 2 and 6 get no tokens: the layout must skip them without a tile.
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, [0, 1, 3, 4, 5, 7], device)
    out = check(x, w13, w2, token_of, slot_of, weight_of)
    assert out.abs().max() > 0.1  # a kernel that wrote nothing would not pass as "close to zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_scratch_is_cleared_by_the_kernels(device, num_tokens, monkeypatch):
    """The slot counts (zeroed by the one-program alignment) and the fp32 sum (zeroed by the
    gate-up launch) come from torch.empty: garbage there must not reach the result."""
    poison_empty(monkeypatch)
    hidden, inter, num_slots, topk = 64, 32, 8, 2
    w13, w2 = make_weights(num_slots, hidden, inter, torch.float32, device)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(device)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, [0, 1, 3, 4, 5, 7], device)
    check(x, w13, w2, token_of, slot_of, weight_of)
    aligned = align_pairs_triton(slot_of, num_slots, 16)
    assert torch.equal(aligned.counts.cpu(), align_pairs_reference(slot_of.cpu(), num_slots, 16).counts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,topk", [(1, 2), (33, 3)])
def test_token_major_pairs_without_token_of(device, num_tokens, topk):
    """The router's layout (token p // k): the kernels derive the token instead of reading it,
    and give what explicit token_of gives."""
    hidden, inter, num_slots = 64, 32, 8
    w13, w2 = make_weights(num_slots, hidden, inter, torch.bfloat16, device, seed=11)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(12)).to(device, torch.bfloat16)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), device, seed=13)
    derived = fused_experts_triton(x, w13, w2, None, slot_of, weight_of)
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of)
    torch.testing.assert_close(derived.float(), want.float(), **TOLERANCE[torch.bfloat16])
    assert torch.equal(fused_experts_reference(x, w13, w2, None, slot_of, weight_of), want)
    three = torch.tensor([0, 1, 2], device=device)
    with pytest.raises(ValueError, match="pairs per token"):  # 3 pairs for 2 tokens
        fused_experts_triton(x.new_zeros(2, hidden), w13, w2, None, three, weight_of.new_ones(3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_is_rounded_sum_plus_add(device, dtype):
    """`add` (the shared experts' output) in the launch that rounds the fp32 sum: bit for bit
    `out.to(dtype) + add` (one pair per token, so the atomics' order cannot move a bit), and
    close to the reference's sum plus add with several pairs per token."""
    hidden, inter, num_slots, t = 64, 32, 8, 9
    w13, w2 = make_weights(num_slots, hidden, inter, dtype, device, seed=21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(t, hidden, generator=g).to(device, dtype)
    add = (torch.randn(t, hidden, generator=g) * 3).to(device, dtype)
    _, slot_of, weight_of = make_routing(t, 1, list(range(num_slots)), device, seed=23)
    got = fused_experts_triton(x, w13, w2, None, slot_of, weight_of, add=add)
    assert got.dtype == dtype and torch.equal(got, fused_experts_triton(x, w13, w2, None, slot_of, weight_of) + add)
    token_of, slot_of, weight_of = make_routing(t, 3, list(range(num_slots)), device, seed=24)
    got = fused_experts(x, w13, w2, None, slot_of, weight_of, add=add)
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of) + add
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    empty = slot_of[:0]
    assert torch.equal(fused_experts_triton(x[:0], w13, w2, None, empty, weight_of[:0], add=add[:0]), add[:0])
    with pytest.raises(ValueError, match="add must be"):
        fused_experts_triton(x, w13, w2, None, slot_of, weight_of, add=add[:, :8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,topk,explicit", [(1, 2, False), (21, 3, False), (21, 3, True), (5, 0, True)])
def test_shared_expert_as_one_more_slot(device, dtype, num_tokens, topk, explicit):
    """The shared expert computed in the routed experts' launches (its tiles after theirs; 21
    tokens leave a part-filled tile) against the reference: the routed sum plus the shared MLP.
    topk 0: no routed pair at all, only the shared expert."""
    hidden, inter, num_slots = 64, 32, 8
    w13, w2 = make_weights(num_slots + 1, hidden, inter, dtype, device, seed=31)
    shared = (w13[num_slots], w2[num_slots])
    w13, w2 = w13[:num_slots], w2[:num_slots]
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(32)).to(device, dtype)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), device, seed=33)
    token_arg = token_of if explicit else None
    got = fused_experts_triton(x, w13, w2, token_arg, slot_of, weight_of, shared=shared)
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of, shared=shared)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    # the reference's shared part is the MLP itself
    gate, up = torch.nn.functional.linear(x, shared[0]).float().chunk(2, dim=-1)
    mlp = torch.nn.functional.linear((torch.nn.functional.silu(gate) * up).to(dtype), shared[1])
    routed = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of)
    torch.testing.assert_close(want.float(), (routed.float() + mlp.float()), **TOLERANCE[dtype])
    assert (got.float() - routed.float()).abs().max() > 0.05  # the shared part was really added
    with pytest.raises(ValueError, match="shared expert"):
        fused_experts_triton(x, w13, w2, token_arg, slot_of, weight_of, shared=(shared[0][:, :8], shared[1]))


SMALL_BLOCKS = MoEGemmConfig(16, (16, 16, 1, 2), (16, 16, 1, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, SMALL_BLOCKS], ids=["default", "small"])
def test_sizes_not_multiples_of_blocks(device, dtype, config):
    # H=40, I=24: K loops and column tiles end in a partial block (several blocks with SMALL_BLOCKS).
    hidden, inter, num_slots, topk, num_tokens = 40, 24, 5, 3, 7
    w13, w2 = make_weights(num_slots, hidden, inter, dtype, device, seed=3)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    check(x, w13, w2, *make_routing(num_tokens, topk, list(range(num_slots)), device, seed=3), config=config)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_row_tile_size(device, block_m):
    # Uneven load (one hot slot spanning several tiles, the rest thin) under each row-tile size.
    hidden, inter, num_slots, num_tokens = 64, 32, 4, 40
    w13, w2 = make_weights(num_slots, hidden, inter, torch.float32, device, seed=5)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(6)).to(device)
    token_of = torch.cat([torch.arange(num_tokens), torch.tensor([0, 3, 9, 39])]).to(device)
    slot_of = torch.cat([torch.zeros(num_tokens, dtype=torch.long), torch.tensor([1, 3, 3, 1])]).to(device)
    weight_of = torch.linspace(0.2, 1.0, token_of.numel()).to(device)
    config = MoEGemmConfig(block_m, (32, 32, 4, 2), (32, 32, 4, 2))
    check(x, w13, w2, token_of, slot_of, weight_of, config=config)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, block_m", [(16, 16), (48, 32), (160, 64), (300, 64)])
def test_built_in_configs(device, dtype, num_tokens, block_m):
    # Each band of pick_config (8, 24, 80 and 150 rows a slot) computes the reference's result;
    # on a GPU this also checks that its tiles fit the shared memory in fp32.
    hidden, inter, num_slots, topk = 64, 32, 4, 2
    config = moe_gemm.pick_config(num_tokens * topk, num_slots, dtype)
    assert config.block_m == block_m
    w13, w2 = make_weights(num_slots, hidden, inter, dtype, device, seed=11)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    check(x, w13, w2, *make_routing(num_tokens, topk, list(range(num_slots)), device, seed=13))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_shared", [False, True])
def test_pair_rows_match_the_atomic_sum(device, dtype, with_shared):
    """Prompt-chunk tiles write a row a pair and sum a token's rows in a second pass
    (MoEGemmConfig.pair_rows) instead of adding into fp32 with atomics: the same result, the
    residual `add` and the fp32 output included, and the same bits on every call."""
    hidden, inter, num_slots, topk, num_tokens = 80, 32, 4, 3, 70  # H past one column block
    w13, w2 = make_weights(num_slots + 1, hidden, inter, dtype, device, seed=41)
    shared = (w13[num_slots], w2[num_slots]) if with_shared else None
    w13, w2 = w13[:num_slots], w2[:num_slots]
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    add = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), device, seed=43)
    atomics = MoEGemmConfig(64, (32, 32, 4, 2), (32, 32, 4, 2))
    rows = atomics._replace(pair_rows=True)
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of, shared=shared)

    def run(config, **kw):
        return fused_experts_triton(x, w13, w2, None, slot_of, weight_of, config=config, shared=shared, **kw)

    got = run(rows)
    assert got.dtype == dtype and torch.equal(got, run(rows))
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(got.float(), run(atomics).float(), **TOLERANCE[dtype])
    summed = run(rows, add=add)
    assert torch.equal(summed, (got.float() + add.float()).to(dtype))  # rounded, added, rounded again
    assert torch.equal(run(rows, add=lambda: add), summed)
    wide = run(rows, fp32_out=True)
    assert wide.dtype == torch.float32
    torch.testing.assert_close(wide, run(atomics, fp32_out=True), **TOLERANCE[dtype])
    # pairs given with their tokens (any order, as expert parallelism delivers them) keep the atomics
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of, config=rows,
                                                    shared=shared).float(), want.float(), **TOLERANCE[dtype])
    assert moe_gemm.pick_config(2048 * 6, 64, dtype).pair_rows and not moe_gemm.pick_config(64 * 6, 64, dtype).pair_rows


@pytest.mark.parametrize("device", DEVICES)
def test_arbitrary_pairs(device):
    """Pairs in any order (as expert parallelism delivers them), tokens with no pair, a token
    sent twice to the same slot: the sum is over pairs, whatever their layout."""
    hidden, inter, num_slots, num_tokens = 64, 32, 8, 6
    w13, w2 = make_weights(num_slots, hidden, inter, torch.float32, device, seed=7)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(8)).to(device)
    token_of = torch.tensor([4, 0, 4, 2, 0, 4, 4]).to(device)
    slot_of = torch.tensor([7, 3, 1, 3, 7, 1, 5]).to(device)
    weight_of = torch.tensor([0.5, 1.0, 0.25, 2.0, 0.75, 0.25, 1.5]).to(device)
    out = check(x, w13, w2, token_of, slot_of, weight_of)
    assert (out[[1, 3, 5]] == 0).all()  # tokens without pairs stay exactly zero
    assert (out[[0, 2, 4]].abs().amax(dim=1) > 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pair_rows", [False, True])
def test_dropped_pairs(device, dtype, pair_rows, monkeypatch):
    """Pairs of slot -1 (another rank's, under expert parallelism) are neither computed nor
    summed: the result is the kept pairs' alone, also where the pair rows of the dropped ones
    hold garbage, and a token with no kept pair gets exactly zero."""
    poison_empty(monkeypatch)
    hidden, inter, num_slots, topk, num_tokens = 64, 32, 4, 3, 40
    w13, w2 = make_weights(num_slots, hidden, inter, dtype, device, seed=51)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(52)).to(device, dtype)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), device, seed=53)
    drop = torch.rand(slot_of.shape, generator=torch.Generator().manual_seed(54)).to(device) < 0.5
    drop[:topk] = True  # token 0: every pair elsewhere
    dropped = torch.where(drop, -1, slot_of)
    kept = ~drop
    config = MoEGemmConfig(16, (32, 32, 4, 2), (32, 32, 4, 2), pair_rows=pair_rows)
    got = fused_experts_triton(x, w13, w2, None, dropped, weight_of, config=config, live_pairs=int(kept.sum()))
    want = fused_experts_reference(x, w13, w2, token_of[kept], slot_of[kept], weight_of[kept])
    assert torch.isfinite(got).all() and (got[0] == 0).all()
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(fused_experts_reference(x, w13, w2, None, dropped, weight_of), want)
    # the dispatcher takes them too, picking tiles by the live pairs
    torch.testing.assert_close(fused_experts(x, w13, w2, None, dropped, weight_of, live_pairs=int(kept.sum())).float(),
                               want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pair_rows", [False, True])
@pytest.mark.parametrize("first,end", [(16, 36), (0, 20), (20, 20)])
def test_shared_expert_on_some_rows(device, dtype, pair_rows, first, end, monkeypatch):
    """An expert-parallel rank computes the shared expert for its own rows of the gathered ones
    (shared_rows) beside the routed pairs it holds (the others dropped): those rows get routed +
    shared, the rest routed only, whatever the unused shared rows of the pair-row scratch hold."""
    poison_empty(monkeypatch)
    hidden, inter, num_slots, topk, num_tokens = 64, 32, 4, 3, 40
    w13, w2 = make_weights(num_slots + 1, hidden, inter, dtype, device, seed=61)
    shared = (w13[num_slots], w2[num_slots])
    w13, w2 = w13[:num_slots], w2[:num_slots]
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(62)).to(device, dtype)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), device, seed=63)
    drop = torch.rand(slot_of.shape, generator=torch.Generator().manual_seed(64)).to(device) < 0.5
    dropped = torch.where(drop, -1, slot_of)
    config = MoEGemmConfig(16, (32, 32, 4, 2), (32, 32, 4, 2), pair_rows=pair_rows)
    got = fused_experts_triton(x, w13, w2, None, dropped, weight_of, config=config, live_pairs=int((~drop).sum()),
                               shared=shared, shared_rows=(first, end))
    routed = fused_experts_reference(x, w13, w2, None, dropped, weight_of)
    want = routed.float().clone()
    want[first:end] += fused_experts_reference(x[first:end], w13, w2, None, dropped[:0], weight_of[:0],
                                               shared=shared).float()
    torch.testing.assert_close(got.float(), want, **TOLERANCE[dtype])
    torch.testing.assert_close(fused_experts_reference(x, w13, w2, None, dropped, weight_of, shared=shared,
                                                       shared_rows=(first, end)).float(), want, **TOLERANCE[dtype])
    if end > first:
        assert (got[first:end].float() - routed[first:end].float()).abs().max() > 0.05  # really added
    outside = torch.ones(num_tokens, dtype=torch.bool)
    outside[first:end] = False
    torch.testing.assert_close(got[outside].float(), routed[outside].float(), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="shared_rows"):
        fused_experts_triton(x, w13, w2, None, dropped, weight_of, shared=shared, shared_rows=(30, 50))


@pytest.mark.parametrize("device", DEVICES)
def test_no_pairs(device):
    w13, w2 = make_weights(4, 64, 32, torch.float32, device)
    x = torch.randn(3, 64).to(device)
    empty_long = torch.empty(0, dtype=torch.long, device=device)
    out = fused_experts_triton(x, w13, w2, empty_long, empty_long, torch.empty(0, device=device))
    assert out.shape == (3, 64) and (out == 0).all()


def assert_valid_layout(aligned, slot_of, num_slots, block_m):
    row_pair, tile_slot = aligned.row_pair.cpu(), aligned.tile_slot.cpu()
    slot_of = slot_of.cpu()
    kept = slot_of >= 0  # slot -1: dropped, in no row
    assert tile_slot.numel() == max_tiles(slot_of.numel(), num_slots, block_m)
    assert row_pair.numel() == tile_slot.numel() * block_m
    assert aligned.counts.cpu().tolist() == torch.bincount(slot_of[kept], minlength=num_slots).tolist()
    # Every kept pair appears exactly once; padding is -1.
    real = row_pair[row_pair >= 0]
    assert sorted(real.tolist()) == kept.nonzero().flatten().tolist()
    assert ((row_pair >= 0) | (row_pair == -1)).all()
    # Each used tile holds rows of its own slot only, packed from its first row; slots ascend.
    rows_slot = torch.where(row_pair >= 0, slot_of[row_pair.clamp(min=0).long()], -1).view(-1, block_m)
    used = tile_slot < num_slots
    assert (tile_slot <= num_slots).all() and (tile_slot[used].diff() >= 0).all()
    for tile in range(tile_slot.numel()):
        members = rows_slot[tile][rows_slot[tile] >= 0]
        if used[tile]:
            assert members.numel() > 0 and (members == tile_slot[tile]).all()
            filled = (rows_slot[tile] >= 0).int()
            assert (filled.diff() <= 0).all()  # padding only at the end of a slot's last tile
        else:
            assert members.numel() == 0
    counts = torch.bincount(slot_of[kept], minlength=num_slots)
    assert int(used.sum()) == int(((counts + block_m - 1) // block_m).sum())
    return real


ALIGN_CASES = [  # (num_slots, slot_of): uneven, with empty slots; many pairs; slots past one block of 128
    (6, torch.tensor([5, 0, 5, 2, 5, 0, 2, 5] * 5)),
    (40, torch.randint(0, 40, (3000,), generator=torch.Generator().manual_seed(11)) // 2 * 2),
    (300, torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(12))),
    # pairs of slot -1 are dropped (expert parallelism: another rank's): in one program and in three
    (6, torch.tensor([5, -1, 0, 5, -1, -1, 2, 5] * 5)),
    (40, torch.randint(-40, 40, (3000,), generator=torch.Generator().manual_seed(13)).clamp(min=-1)),
    (8, torch.full((50,), -1)),
]


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", range(len(ALIGN_CASES)))
def test_align_reference_layout(case, block_m):
    num_slots, slot_of = ALIGN_CASES[case]
    real = assert_valid_layout(align_pairs_reference(slot_of, num_slots, block_m), slot_of, num_slots, block_m)
    for slot in range(num_slots):  # the reference keeps each slot's pairs in order (stable sort)
        assert (real[slot_of[real.long()] == slot].diff() > 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("case", range(len(ALIGN_CASES)))
def test_align_triton_matches_reference(device, case, block_m):
    num_slots, slot_of = ALIGN_CASES[case]
    got = align_pairs_triton(slot_of.to(device), num_slots, block_m)
    want = align_pairs_reference(slot_of, num_slots, block_m)
    assert_valid_layout(got, slot_of, num_slots, block_m)
    assert torch.equal(got.tile_slot.cpu(), want.tile_slot)
    assert torch.equal(got.counts.cpu(), want.counts)
    assert torch.equal(got.row_pair.cpu() >= 0, want.row_pair >= 0)


def test_max_tiles_is_worst_case():
    # Every slot holding a single pair is the most padding the layout can need.
    for num_pairs, num_slots, block_m in [(1, 8, 16), (8, 8, 16), (40, 8, 16), (100, 64, 128)]:
        slot_of = torch.arange(num_pairs) % num_slots
        aligned = align_pairs_reference(slot_of, num_slots, block_m)
        worst = sum(-(-int(c) // block_m) for c in aligned.counts)
        assert worst <= max_tiles(num_pairs, num_slots, block_m)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels natively")
def test_interpreter_is_on():
    assert not IMPORTED_TOO_EARLY, \
        "triton was imported before TRITON_INTERPRET=1 was set: set it in tests/conftest.py before importing engine"


def test_dispatcher_on_cpu():
    w13, w2 = make_weights(8, 64, 32, torch.float32, "cpu")
    x = torch.randn(5, 64)
    pairs = make_routing(5, 2, list(range(8)), "cpu")
    torch.testing.assert_close(fused_experts(x, w13, w2, *pairs), fused_experts_reference(x, w13, w2, *pairs),
                               **TOLERANCE[torch.float32])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_no_host_sync_and_cuda_graph():
    hidden, inter, num_slots, num_tokens, topk = 128, 64, 8, 24, 2
    w13, w2 = make_weights(num_slots, hidden, inter, torch.bfloat16, "cuda")
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    token_of, slot_of, weight_of = make_routing(num_tokens, topk, list(range(num_slots)), "cuda")
    fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = fused_experts_triton(x, w13, w2, token_of, slot_of, weight_of)
    # New routing in the same buffers: the replay must follow it.
    new_tokens, new_slots, new_weights = make_routing(num_tokens, topk, [1, 2, 5], "cuda", seed=9)
    slot_of.copy_(new_slots)
    weight_of.copy_(new_weights)
    graph.replay()
    torch.cuda.synchronize()
    want = fused_experts_reference(x, w13, w2, token_of, slot_of, weight_of)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCE[torch.bfloat16])


def test_module_keeps_engine_out():
    # wideep_kernels/ sits below engine/: importing engine or ray from here would invert the layering.
    source = Path(moe_gemm.__file__).read_text()
    assert "import ray" not in source and "from engine" not in source and "import engine" not in source


@pytest.mark.parametrize("device", DEVICES)
def test_moe_layer_shared_expert_fused_or_separate(device, monkeypatch):
    """A DeepSeekMoE layer (engine/moe.py) gives the same output with its shared expert computed
    as one more slot of the fused kernels as with it as a separate MLP, and counts the same load."""
    from engine.config import preset
    from engine.moe import MoE
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")  # CPU tensors take the (interpreted) kernels only when asked
    cfg = preset("tiny")
    torch.manual_seed(41)
    moe = MoE(cfg).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(42)).to(device)
    assert moe._shared_slot(x) is not None
    with torch.no_grad():
        fused = moe(x)
        fused_load = moe.take_load()
        moe.fuse_shared = False
        assert moe._shared_slot(x) is None
        separate = moe(x)
        assert torch.equal(moe.take_load(), fused_load) and int(fused_load.sum()) == 7 * cfg.num_experts_per_tok
        moe.fuse_shared = True
        routed_only = moe.experts(x, *_route_of(moe, x))
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-5)
    assert (fused - routed_only).abs().max() > 0.05
    # Two shared experts make one MLP twice as wide as a routed slot: it stays a separate MLP.
    wide = MoE(preset("tiny", n_shared_experts=2)).to(device)
    assert wide._shared_slot(x) is None
    with torch.no_grad():
        assert wide(x).shape == x.shape


def _route_of(moe, x):
    from engine.moe import route
    logits = torch.nn.functional.linear(x.float(), moe.gate.weight.float())
    _, weights, slots = route(logits, moe.gate.e_score_correction_bias, moe.cfg, moe.expert_map)
    return slots, weights
