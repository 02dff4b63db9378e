"""Fused MoE routing kernel against its torch reference (and the reference against engine/moe.py)."""
import pytest
import torch

from kernel_devices import DEVICES, IMPORTED_TOO_EARLY

triton = pytest.importorskip("triton")

from wideep_kernels.routing import fused_route, gate_parts_triton, route_reference, route_triton  # noqa: E402



@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels natively")
def test_interpreter_is_on():
    assert not IMPORTED_TOO_EARLY, \
        "triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py before importing engine"


def expert_map(phys2log: list[int], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phys [E, R], num_replicas [E]) from the logical expert of each slot, -1 padded."""
    num_replicas = torch.bincount(torch.tensor(phys2log), minlength=num_experts)
    log2phys = torch.full((num_experts, int(num_replicas.max())), -1, dtype=torch.long)
    fill = [0] * num_experts
    for slot, e in enumerate(phys2log):
        log2phys[e, fill[e]] = slot
        fill[e] += 1
    return log2phys, num_replicas


def replicated_map(num_experts: int, extra: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every expert once plus `extra` redundant slots of random experts, slots shuffled."""
    g = torch.Generator().manual_seed(seed)
    phys = list(range(num_experts)) + torch.randint(0, num_experts, (extra,), generator=g).tolist()
    phys = [phys[i] for i in torch.randperm(len(phys), generator=g).tolist()]
    log2phys, num_replicas = expert_map(phys, num_experts)
    return log2phys, num_replicas, len(phys)


def inputs(t, e, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g).to(dtype)
    bias = torch.randn(e, generator=g) * 0.1
    return logits.to(device), bias.to(device)


def compare(device, t, e, n_group, topk_group, top_k, norm, scaling, extra_slots=0, seed=0,
            dtype=torch.float32, block_t=None, logits=None):
    if logits is None:
        logits, bias = inputs(t, e, seed, device, dtype)
    else:
        bias = inputs(1, e, seed, device)[1]
    log2phys, num_replicas, num_slots = replicated_map(e, extra_slots, seed)
    log2phys, num_replicas = log2phys.to(device), num_replicas.to(device)
    # Non-zero starting counts: the kernel must add to them, not overwrite.
    start = torch.arange(num_slots, dtype=torch.long, device=device) * 3
    load_ref, load_tri = start.clone(), start.clone()
    args = (n_group, topk_group, top_k, norm, scaling, log2phys, num_replicas)
    ids_r, w_r, s_r = route_reference(logits, bias, *args, load_ref)
    ids_t, w_t, s_t = route_triton(logits, bias, *args, load_tri, block_t=block_t)
    assert ids_t.dtype == torch.long and s_t.dtype == torch.long and w_t.dtype == torch.float32
    assert ids_t.shape == w_t.shape == s_t.shape == (t, top_k)
    assert torch.equal(ids_t, ids_r)
    torch.testing.assert_close(w_t, w_r, atol=1e-6, rtol=0)
    assert torch.equal(s_t, s_r)
    assert torch.equal(load_tri, load_ref)
    assert int((load_tri - start).sum()) == t * top_k
    return ids_t.cpu(), s_t.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [1, 3, 7, 16])
def test_no_groups(device, t):
    compare(device, t, 8, n_group=1, topk_group=1, top_k=2, norm=True, scaling=1.0, seed=t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,e,n_group,topk_group,top_k,norm,scaling", [
    (1, 8, 2, 1, 2, True, 2.5),
    (5, 8, 2, 1, 3, False, 1.0),
    (9, 16, 4, 2, 3, True, 2.5),
    (6, 12, 3, 2, 4, True, 1.5),     # E and n_group not powers of two: padded columns and groups
    (3, 256, 8, 4, 8, True, 2.5),    # DeepSeek-V3
])
def test_groups(device, t, e, n_group, topk_group, top_k, norm, scaling):
    compare(device, t, e, n_group, topk_group, top_k, norm, scaling, seed=e + t)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_t", [1, 2, 4])
def test_replicas_and_partial_blocks(device, block_t):
    # 11 tokens: the last block is partial for every block_t; 10 redundant slots over 16 experts
    _, slots = compare(device, 11, 16, 4, 2, 4, True, 2.5, extra_slots=10, seed=block_t, block_t=block_t)
    assert slots.max() < 26


@pytest.mark.parametrize("device", DEVICES)
def test_replicas_split_by_token_row(device):
    # Every token picks the same experts (a huge bias); 3 replicas of expert 0 alternate by row.
    log2phys, num_replicas = expert_map([0, 1, 2, 3, 0, 0, 1], 4)
    logits = torch.zeros(7, 4, device=device)
    bias = torch.tensor([4.0, 2.0, 0.0, -2.0], device=device)
    load = torch.zeros(7, dtype=torch.long, device=device)
    ids, w, slots = route_triton(logits, bias, 1, 1, 2, True, 1.0, log2phys.to(device), num_replicas.to(device), load)
    assert ids.cpu().tolist() == [[0, 1]] * 7
    assert slots[:, 0].cpu().tolist() == [0, 4, 5, 0, 4, 5, 0]
    assert slots[:, 1].cpu().tolist() == [1, 6, 1, 6, 1, 6, 1]
    assert load.cpu().tolist() == [3, 4, 0, 0, 2, 2, 3]
    torch.testing.assert_close(w.cpu(), torch.full((7, 2), 0.5), atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_group_limit_changes_the_choice(device):
    # The two best experts sit in different groups, but group 1 wins on its two best together:
    # group-limited routing must pick within group 1 only.
    logits = torch.tensor([[3.0, -3.0, -3.0, -3.0, 2.0, 1.9, -3.0, -3.0]], device=device)
    bias = torch.zeros(8, device=device)
    log2phys, num_replicas = expert_map(list(range(8)), 8)
    args = (True, 1.0, log2phys.to(device), num_replicas.to(device))
    grouped, _, _ = route_triton(logits, bias, 2, 1, 2, *args)
    flat, _, _ = route_triton(logits, bias, 1, 1, 2, *args)
    assert grouped.cpu().tolist() == [[4, 5]]
    assert flat.cpu().tolist() == [[0, 4]]


@pytest.mark.parametrize("device", DEVICES)
def test_bias_steers_choice_not_weights(device):
    logits = torch.tensor([[1.0, 0.0, -1.0, -2.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], device=device)
    log2phys, num_replicas = expert_map(list(range(4)), 4)
    ids, w, _ = route_triton(logits, bias, 1, 1, 2, False, 2.0, log2phys.to(device), num_replicas.to(device))
    assert ids.cpu().tolist() == [[3, 0]]
    expect = torch.tensor([[-2.0, 1.0]]).sigmoid() * 2.0
    torch.testing.assert_close(w.cpu(), expect, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_strided_logits(device):
    compare(device, 5, 16, 4, 2, 3, True, 2.5, seed=3, dtype=torch.bfloat16)
    wide = inputs(5, 32, 4, device)[0]
    compare(device, 5, 16, 4, 2, 3, True, 2.5, seed=4, logits=wide[:, 8:24])


@pytest.mark.parametrize("device", DEVICES)
def test_no_tokens(device):
    log2phys, num_replicas = expert_map(list(range(8)), 8)
    load = torch.ones(8, dtype=torch.long, device=device)
    ids, w, slots = route_triton(torch.empty(0, 8, device=device), torch.zeros(8, device=device), 2, 1, 2, True, 1.0,
                                 log2phys.to(device), num_replicas.to(device), load)
    assert ids.shape == w.shape == slots.shape == (0, 2)
    assert load.cpu().tolist() == [1] * 8


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_without_counts(device):
    logits, bias = inputs(4, 16, 9, device)
    log2phys, num_replicas, _ = replicated_map(16, 4, 9)
    args = (4, 2, 4, True, 2.5, log2phys.to(device), num_replicas.to(device))
    ids, w, slots = fused_route(logits, bias, *args)
    ids_r, w_r, slots_r = route_reference(logits, bias, *args)
    assert torch.equal(ids, ids_r) and torch.equal(slots, slots_r)
    torch.testing.assert_close(w, w_r, atol=1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_and_other_ranks_slots(device):
    """Expert parallelism: a rank's map names only its own slots (-1 for another rank's), and
    rows that are not real (padding) get -1 for every pair, in the routing launch itself; the
    count skips both. The ids and weights stay those of the plain routing."""
    t, e = 6, 16
    logits, bias = inputs(t, e, 11, device)
    log2phys, num_replicas, num_slots = replicated_map(e, 4, 11)
    local = torch.where(log2phys < num_slots // 2, log2phys, -1)  # this rank holds the first half
    real = torch.tensor([True, True, False, True, False, False], device=device)
    args = (4, 2, 4, True, 2.5, local.to(device), num_replicas.to(device))
    load_t = torch.zeros(num_slots, dtype=torch.long, device=device)
    load_r = load_t.clone()
    ids_t, w_t, s_t = route_triton(logits, bias, *args, load_t, real=real)
    ids_r, w_r, s_r = route_reference(logits, bias, *args, load_r, real)
    ids_p, w_p, s_p = route_reference(logits, bias, *args)
    assert torch.equal(ids_t, ids_r) and torch.equal(ids_t, ids_p) and torch.equal(s_t, s_r)
    torch.testing.assert_close(w_t, w_p, atol=1e-6, rtol=0)
    assert (s_t[~real] == -1).all()
    assert torch.equal(s_t[real], s_p[real]) and (s_t[real] == -1).any() and (s_t[real] >= 0).any()
    assert torch.equal(load_t, load_r) and int(load_t.sum()) == int((s_t >= 0).sum())
    ids_d, _, s_d = fused_route(logits, bias, *args, real=real)
    assert torch.equal(s_d, s_t) and torch.equal(ids_d, ids_t)
    with pytest.raises(ValueError, match="real"):
        route_triton(logits, bias, *args, real=real[:4])


def test_rejects_impossible_shapes():
    log2phys, num_replicas = expert_map(list(range(8)), 8)
    logits, bias = torch.zeros(2, 8), torch.zeros(8)
    with pytest.raises(ValueError):  # only 1 group of 4 experts is eligible
        route_triton(logits, bias, 2, 1, 5, True, 1.0, log2phys, num_replicas)
    with pytest.raises(ValueError):
        route_triton(logits, bias, 3, 1, 2, True, 1.0, log2phys, num_replicas)


@pytest.mark.skipif(IMPORTED_TOO_EARLY, reason="see test_interpreter_is_on")
def test_engine_route_wiring():
    # engine.moe.route delegates to fused_route: its arguments must line up, and its slots must
    # be what ExpertMap.slots_for gives for the chosen experts.
    from types import SimpleNamespace

    from engine.moe import ExpertMap, route

    logits, bias = inputs(6, 16, 11, "cpu")
    cfg = SimpleNamespace(n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=True,
                          routed_scaling_factor=2.5)
    emap = ExpertMap(torch.tensor([3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 7]), 16)
    load_e, load_r = torch.zeros(18, dtype=torch.long), torch.zeros(18, dtype=torch.long)
    ids_e, w_e, slots_e = route(logits, bias, cfg, emap, load_e)
    ids, w, slots = route_reference(logits, bias, 4, 2, 3, True, 2.5, emap.log2phys, emap.num_replicas, load_r)
    assert torch.equal(ids, ids_e) and torch.equal(slots, slots_e) and torch.equal(load_r, load_e)
    torch.testing.assert_close(w_e, w, atol=1e-6, rtol=0)
    assert torch.equal(slots, emap.slots_for(ids))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t,h,dtype", [(1, 64, torch.float32), (5, 300, torch.bfloat16), (40, 2048, torch.bfloat16),
                                       (100, 256, torch.bfloat16)])
def test_gate_parts_sum_to_the_fp32_logits(device, t, h, dtype):
    """Partial router logits over slices of the hidden size (2048: 32 of them; 300: the last one
    cut short) add up to x.float() @ w.float().T, for token counts that fill part of a program's
    block and (100) more than one block; the route kernel sums them and routes as the reference
    does on the full logits."""
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w = (torch.randn(16, h, generator=g) / h ** 0.5).to(dtype).to(device)
    parts = gate_parts_triton(x, w)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (t, 16)
    assert parts.shape[0] == {64: 1, 256: 4, 300: 5, 2048: 32}[h]
    logits = torch.nn.functional.linear(x.float(), w.float())
    torch.testing.assert_close(parts.sum(0), logits, atol=1e-5, rtol=1e-5)
    bias = inputs(1, 16, 3, device)[1]
    log2phys, num_replicas, num_slots = replicated_map(16, 4, 1)
    args = (4, 2, 3, True, 2.5, log2phys.to(device), num_replicas.to(device))
    load_p, load_r = (torch.zeros(num_slots, dtype=torch.long, device=device) for _ in range(2))
    ids_p, w_p, s_p = route_triton(parts, bias, *args, load_p)
    ids_r, w_r, s_r = route_reference(logits, bias, *args, load_r)
    assert torch.equal(ids_p, ids_r) and torch.equal(s_p, s_r) and torch.equal(load_p, load_r)
    torch.testing.assert_close(w_p, w_r, atol=1e-6, rtol=0)
    # the reference takes parts too, and so does the dispatcher
    assert torch.equal(route_reference(parts, bias, *args)[0], ids_r)
    assert torch.equal(fused_route(parts, bias, *args)[0], ids_r)
    with pytest.raises(ValueError, match="hidden size"):
        gate_parts_triton(x, w[:, :-1])
