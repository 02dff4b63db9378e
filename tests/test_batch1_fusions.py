"""Batch-1 decode launches folded into their neighbours: each RMSNorm computed by the kernel that
reads its output (the attention's input projection, the MoE router), and the MoE pairs' layout
made by the routing kernel. Kernels against the unfused launches they replace, and the engine
with and without the folds."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kernel_devices import DEVICES, gemv_close_to_exact as close_to_exact

triton = pytest.importorskip("triton")

from wideep_kernels.gemv import gemv_triton, norm_gemv_applies, norm_gemv_triton  # noqa: E402
from wideep_kernels.moe_align import align_pairs_reference  # noqa: E402
from wideep_kernels.rmsnorm import add_rms_norm_reference, rms_norm_reference  # noqa: E402
from wideep_kernels.routing import (  # noqa: E402
    gate_norm_applies,
    gate_parts_norm_triton,
    route_reference,
    route_triton,
)


@pytest.fixture(autouse=True)
def cpu_kernels(monkeypatch):
    """CPU tensors take the (interpreted) kernels only when asked for (wideep_kernels.triton_ok)."""
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")


def _row(k, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return [t.to(device) for t in (torch.randn(1, k, generator=g).to(dtype),
                                   torch.randn(1, k, generator=g).to(dtype),
                                   (1 + 0.2 * torch.randn(k, generator=g)).to(dtype))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,n,x_fp32", [(64, 29, False), (130, 17, True), (40, 8, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_gemv_is_the_norm_then_the_projection(device, k, n, x_fp32, dtype):
    x, residual, norm_w = _row(k, dtype, k + n, device)
    if x_fp32:  # the routed experts' unrounded sum on a 16-bit residual
        x = x.float() + 1e-3
    w = (0.1 * torch.randn(n, k, generator=torch.Generator().manual_seed(n))).to(dtype).to(device)
    assert norm_gemv_applies(x, residual, norm_w, w, None)
    stream = torch.full_like(residual, float("nan"))
    out = norm_gemv_triton(x, residual, norm_w, 1e-6, w, stream)
    y, h = add_rms_norm_reference(x, residual, norm_w, 1e-6)
    assert torch.equal(stream, h)  # the residual stream, as add_rms_norm gives it
    close_to_exact(out, y, w)
    # without a residual: the norm of x alone, and nothing written
    out = norm_gemv_triton(residual, None, norm_w, 1e-6, w)
    close_to_exact(out, rms_norm_reference(residual, norm_w, 1e-6), w)


def test_norm_gemv_applies_only_to_one_16_bit_row(monkeypatch):
    x, residual, norm_w = _row(32, torch.bfloat16, 0, "cpu")
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert norm_gemv_applies(x, residual, norm_w, w, None)
    assert gate_norm_applies(x, residual, norm_w, w)
    assert not norm_gemv_applies(x.expand(2, -1), residual.expand(2, -1), norm_w, w, None)  # two rows
    assert not norm_gemv_applies(x, residual, norm_w.float(), w, None)  # the norm's weight in another dtype
    assert not norm_gemv_applies(x, residual, norm_w, w, torch.zeros(8, dtype=w.dtype, device=w.device))
    assert not norm_gemv_applies(x.half(), residual, norm_w, w, None)  # x neither the stream's dtype nor fp32
    assert not gate_norm_applies(x, None, norm_w, w)  # the router's fold needs a residual
    assert not gate_norm_applies(x.expand(2, -1), residual.expand(2, -1), norm_w, w)
    monkeypatch.delenv("WIDEEP_CPU_KERNELS")  # CPU tensors take the torch path unless the kernels are asked for
    assert not norm_gemv_applies(x, residual, norm_w, w, None) and not gate_norm_applies(x, residual, norm_w, w)


def test_norm_gemv_needs_a_stream_with_a_residual():
    x, residual, norm_w = _row(16, torch.bfloat16, 1, "cpu")
    w = torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stream"):
        norm_gemv_triton(x, residual, norm_w, 1e-6, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden,experts", [(64, 16), (2304, 40)])
def test_router_with_the_norm_in_its_launch(device, hidden, experts):
    """2304 columns: the parts are 128 columns wide (gate_parts_triton's split), not 64."""
    x, residual, norm_w = _row(hidden, torch.bfloat16, hidden, device)
    x = x.float() * 3
    w = (0.1 * torch.randn(experts, hidden, generator=torch.Generator().manual_seed(2))).bfloat16().to(device)
    assert gate_norm_applies(x, residual, norm_w, w)
    stream = torch.full_like(residual, float("nan"))
    parts, normed = gate_parts_norm_triton(x, residual, norm_w, 1e-6, w, stream)
    y, h = add_rms_norm_reference(x, residual, norm_w, 1e-6)
    assert torch.equal(stream, h) and torch.equal(normed, y)
    assert parts.shape[1:] == (1, experts) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), y.float() @ w.float().T, atol=1e-5, rtol=1e-5)
    # a route over the parts equals one over their sum
    log2phys = torch.arange(experts, device=device)[:, None]
    args = (torch.zeros(experts, device=device), 1, 1, 4, True, 1.0, log2phys, torch.ones(experts, dtype=torch.long,
                                                                                          device=device))
    assert torch.equal(route_triton(parts, *args)[0], route_reference(y.float() @ w.float().T, *args)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("experts,n_group,topk_group,top_k,replicas,block_m", [
    (16, 4, 2, 3, 2, 16),    # groups, every expert twice: one token takes its first replicas
    (32, 1, 1, 8, 1, 16),
    (8, 1, 1, 1, 1, 64),     # one pair, a wider tile
    (64, 8, 4, 6, 1, 32),
])
def test_route_lays_out_one_tokens_pairs(device, experts, n_group, topk_group, top_k, replicas, block_m):
    g = torch.Generator().manual_seed(experts + top_k)
    slots = experts * replicas
    perm = torch.randperm(slots, generator=g)  # replicas scattered over the slots
    log2phys = perm.view(replicas, experts).T.contiguous().to(device)
    num_replicas = torch.full((experts,), replicas, dtype=torch.long, device=device)
    for trial in range(3):
        logits = torch.randn(1, experts, generator=g).to(device)
        bias = (0.1 * torch.randn(experts, generator=g)).to(device)
        args = (logits, bias, n_group, topk_group, top_k, True, 2.5, log2phys, num_replicas)
        load = torch.zeros(slots, dtype=torch.long, device=device)
        ids, weights, got_slots, layout = route_triton(*args, load, align=(slots, block_m))
        want = route_reference(*args)
        assert torch.equal(ids, want[0]) and torch.equal(got_slots, want[2])
        torch.testing.assert_close(weights, want[1])
        ref = align_pairs_reference(got_slots.flatten(), slots, block_m)
        for name, a, b in zip(("row_pair", "tile_slot", "counts"), layout, ref):
            assert torch.equal(a, b), (name, a, b)
        assert load.sum() == top_k  # the balancer's count still taken


def test_route_layout_refuses_what_it_cannot_lay_out():
    logits, bias = torch.zeros(2, 8), torch.zeros(8)
    log2phys, reps = torch.arange(8)[:, None], torch.ones(8, dtype=torch.long)
    with pytest.raises(ValueError, match="one token"):
        route_triton(logits, bias, 1, 1, 2, True, 1.0, log2phys, reps, align=(8, 16))
    with pytest.raises(ValueError, match="power-of-two"):
        route_triton(logits[:1], bias, 1, 1, 2, True, 1.0, log2phys, reps, align=(8, 12))


def test_engine_with_and_without_the_batch1_folds(tiny_ckpt, tiny_v4_ckpt):
    """The engine in bf16 with the kernels interpreted on CPU: one request decoding alone takes
    the folded launches (counted), and generates what it generates with them turned off; a batch
    of two takes none of them. Fresh process: the interpreter is chosen before triton's import."""
    code = textwrap.dedent(f"""
        import torch
        import engine.model, engine.moe, wideep_kernels.moe_align
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling import SamplingParams
        orig = (engine.model.MLAttention.takes_norm, engine.moe.MoE.takes_norm, engine.moe.MoE._align_in_router)
        calls = {{}}
        def count(mod, name):
            fn = getattr(mod, name)
            def wrapped(*a, _fn=fn, **k):
                key = name + ("+align" if k.get("align") else "")
                calls[key] = calls.get(key, 0) + 1
                return _fn(*a, **k)
            setattr(mod, name, wrapped)
        count(engine.model, "norm_gemv_triton")
        count(engine.moe, "gate_parts_norm_triton")
        count(wideep_kernels.moe_align, "align_pairs_triton")
        import wideep_kernels.routing
        count(wideep_kernels.routing, "route_triton")
        p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (9, 21)]
        for ckpt in ({str(tiny_ckpt)!r}, {str(tiny_v4_ckpt)!r}):
            outs = {{}}
            for fold in (True, False):
                if not fold:
                    engine.model.MLAttention.takes_norm = lambda *a: False
                    engine.moe.MoE.takes_norm = lambda *a: False
                    engine.moe.MoE._align_in_router = lambda *a: None
                calls.clear()
                e = LLMEngine.from_pretrained(ckpt, EngineConfig(block_size=4, dtype="bfloat16"), progress=False)
                outs[fold] = [e.generate([pr], p)[0].output_token_ids for pr in prompts]
                if fold:
                    assert calls.get("norm_gemv_triton", 0) > 0 and calls.get("gate_parts_norm_triton", 0) > 0, calls
                    assert calls.get("route_triton+align", 0) > 0, calls
                    one = dict(calls)
                    calls.clear()
                    e.generate(prompts, p)  # two at once: rows of two, nothing folded
                    assert "norm_gemv_triton" not in calls and "route_triton+align" not in calls, calls
                    calls.update(one)
                else:
                    assert not any(k in calls for k in ("norm_gemv_triton", "gate_parts_norm_triton",
                                                       "route_triton+align")), calls
            assert outs[True] == outs[False], outs
            engine.model.MLAttention.takes_norm, engine.moe.MoE.takes_norm, engine.moe.MoE._align_in_router = orig
        print("OK", one)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", WIDEEP_CPU_KERNELS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
