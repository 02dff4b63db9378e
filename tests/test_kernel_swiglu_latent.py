"""SwiGLU activation and MLA latent kernels against their torch references (and the latent
reference against the engine's norm and rope modules)."""
import pytest
import torch

from kernel_devices import DEVICES, IMPORTED_TOO_EARLY, within_ulp

triton = pytest.importorskip("triton")

from engine.layers import RMSNorm, Rotary  # noqa: E402
from wideep_kernels import latent as latent_module  # noqa: E402
from wideep_kernels import swiglu as swiglu_module  # noqa: E402
from wideep_kernels.latent import (  # noqa: E402
    latent_and_query, latent_and_query_reference, latent_reference, latent_triton, norm_rope_latent,
)
from wideep_kernels.swiglu import silu_mul, silu_mul_reference, silu_mul_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels natively")
def test_interpreter_is_on():
    assert not IMPORTED_TOO_EARLY, "triton was imported before TRITON_INTERPRET=1 was set"
    assert type(swiglu_module._silu_mul_kernel).__name__ == "InterpretedFunction"
    assert type(latent_module._latent_kernel).__name__ == "InterpretedFunction"


def rope_tables(t, rope, interleave=False, seed=0, device="cpu"):
    rot = Rotary(rope, 10000.0, interleave, 128, "cpu")
    pos = torch.randint(0, 100_000, (t,), generator=torch.Generator().manual_seed(seed))
    rot.ensure(int(pos.max()) if t else 0)
    cos, sin = rot.tables(pos)
    return rot, cos.to(device), sin.to(device)


# ---- silu(gate) * up ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 96), (5, 2 * 1500), (3, 4, 2 * 40)])
def test_silu_mul_matches_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(shape[-1])
    gu = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)  # far into both tails of silu
    out = silu_mul_triton(gu)
    assert out.shape == shape[:-1] + (shape[-1] // 2,)
    within_ulp(out, silu_mul_reference(gu))


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_strided_empty_and_errors(device):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 2 * 64 + 16, generator=g).to(torch.bfloat16).to(device)
    gu = wide[:, 16:]  # rows of a wider buffer: the kernel reads them in place
    within_ulp(silu_mul_triton(gu), silu_mul_reference(gu))
    empty = silu_mul_triton(torch.zeros(0, 32, dtype=torch.bfloat16, device=device))
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="even"):
        silu_mul_triton(torch.zeros(2, 33, device=device))
    with pytest.raises(ValueError, match="float32/bfloat16/float16"):
        silu_mul_triton(torch.zeros(2, 32, dtype=torch.float64, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_dispatcher(device, monkeypatch):
    gu = torch.randn(3, 64).to(torch.bfloat16).to(device)
    calls = []
    real = swiglu_module.silu_mul_triton
    monkeypatch.setattr(swiglu_module, "silu_mul_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    within_ulp(silu_mul(gu), silu_mul_reference(gu))
    assert calls == [1]
    silu_mul(gu.double())  # a dtype the kernel does not take stays on the reference
    silu_mul(gu.float().requires_grad_())
    assert calls == [1]
    if device == "cpu":
        monkeypatch.delenv("WIDEEP_CPU_KERNELS")
        assert torch.equal(silu_mul(gu), silu_mul_reference(gu))
        assert calls == [1]


# ---- [norm(c_kv) | rope(k_rope)] ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("t,c,rope", [(1, 32, 8), (7, 48, 6), (3, 512, 64)])
def test_latent_matches_reference(device, dtype, interleave, t, c, rope):
    g = torch.Generator().manual_seed(c + rope)
    # The kv part of the fused input projection: a column slice of a wider GEMM output.
    proj = (torch.randn(t, 16 + c + rope + 24, generator=g) * 3).to(dtype).to(device)
    kv = proj[:, 16:16 + c + rope]
    w = (torch.randn(c, generator=g) * 0.5 + 1).to(dtype).to(device)
    _, cos, sin = rope_tables(t, rope, interleave, device=device)
    out = latent_triton(kv, w, 1e-6, cos, sin, interleave)
    within_ulp(out, latent_reference(kv, w, 1e-6, cos, sin, interleave))


@pytest.mark.parametrize("interleave", [False, True])
def test_latent_reference_is_the_engine(interleave):
    """The reference is what the attention layer computed with its modules before the fusion."""
    g = torch.Generator().manual_seed(2)
    c, rope, t = 32, 8, 5
    kv = torch.randn(t, c + rope, generator=g).to(torch.bfloat16)
    norm = RMSNorm(c).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(c, generator=g))
    rot, cos, sin = rope_tables(t, rope, interleave)
    c_kv, k_rope = kv.split([c, rope], dim=-1)
    engine = torch.cat([norm(c_kv), rot.apply(k_rope, cos, sin)], dim=-1)
    assert torch.equal(latent_reference(kv, norm.weight.detach(), norm.eps, cos, sin, interleave), engine)


@pytest.mark.parametrize("device", DEVICES)
def test_latent_empty_errors_and_dispatch(device, monkeypatch):
    _, cos, sin = rope_tables(2, 8, device=device)
    w = torch.ones(32, dtype=torch.bfloat16, device=device)
    empty = latent_triton(torch.zeros(0, 40, dtype=torch.bfloat16, device=device), w, 1e-6, cos[:0], sin[:0], False)
    assert empty.shape == (0, 40)
    kv = torch.randn(2, 40).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="share"):
        latent_triton(kv, w.float(), 1e-6, cos, sin, False)
    with pytest.raises(ValueError, match="even rope part"):
        latent_triton(kv[:, :39], w, 1e-6, cos, sin, False)
    with pytest.raises(ValueError, match="cos and sin"):
        latent_triton(kv, w, 1e-6, cos[:1], sin[:1], False)
    calls = []
    real = latent_module.latent_triton
    monkeypatch.setattr(latent_module, "latent_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    within_ulp(norm_rope_latent(kv, w, 1e-6, cos, sin, True), latent_reference(kv, w, 1e-6, cos, sin, True))
    assert calls == [1]
    # A weight of another dtype (the reference promotes) stays on the reference.
    assert norm_rope_latent(kv, w.float(), 1e-6, cos, sin, True).dtype == torch.float32
    assert calls == [1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("write", [False, True])
def test_latent_and_query_in_one_launch(device, dtype, write, monkeypatch):
    """The latent, the query's low-rank norm and (a source layer at decode) the cache writes of the
    latent and the indexer key, from one input-projection row: against the references and torch
    writes; slots of padding rows may repeat."""
    g = torch.Generator().manual_seed(5)
    t, qc, c, rope, kd, num_slots = 6, 48, 32, 8, 16, 20
    proj = (torch.randn(t, qc + c + rope + kd, generator=g) * 3).to(dtype).to(device)
    q, kv, key = proj[:, :qc], proj[:, qc:qc + c + rope], proj[:, qc + c + rope:]
    w = (torch.randn(c, generator=g) * 0.5 + 1).to(dtype).to(device)
    qw = (torch.randn(qc, generator=g) * 0.5 + 1).to(dtype).to(device)
    _, cos, sin = rope_tables(t, rope, False, device=device)
    slots = torch.tensor([3, 7, 0, 19, 5, 5], device=device)
    slabs = [(torch.zeros(num_slots, c + rope, dtype=dtype, device=device),
              torch.zeros(num_slots, kd, dtype=dtype, device=device)) for _ in range(2)]
    writes = [(slots, slab, key, key_slab) if write else None for slab, key_slab in slabs]
    latent, q_low = latent_triton(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), writes[0])
    want_latent, want_q = latent_and_query_reference(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), writes[1])
    within_ulp(latent, want_latent)
    within_ulp(q_low, want_q)
    if write:
        (slab, key_slab), (ref_slab, _) = slabs
        assert torch.equal(slab[slots[:4]], latent[:4]) and torch.equal(key_slab[slots[:4]], key[:4])
        # the two rows of slot 5 (padding) race, each store of a row on its own: every element of
        # the slot comes from one of them (on the GPU, mixes were seen)
        for got, rows in ((slab[5], latent[4:6]), (key_slab[5], key[4:6])):
            assert ((got == rows[0]) | (got == rows[1])).all()
        assert torch.equal(slab.ne(0).any(1), ref_slab.ne(0).any(1))  # no other row was written
    # the dispatcher: the kernel where it applies, the references elsewhere (CPU without the opt-in)
    monkeypatch.delenv("WIDEEP_CPU_KERNELS", raising=False)
    got = latent_and_query(kv, w, 1e-6, cos, sin, False, q, qw, 1e-5)
    if device == "cpu":
        assert torch.equal(got[0], want_latent) and torch.equal(got[1], want_q)
    with pytest.raises(ValueError, match="q_norm"):
        latent_triton(kv, w, 1e-6, cos, sin, False, (q[:2], qw, 1e-5))
    with pytest.raises(ValueError, match="write needs"):
        latent_triton(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), (slots, slabs[0][0][:, :4], key, slabs[0][1]))


@pytest.mark.parametrize("device", DEVICES)
def test_latent_write_quantises_fp8_index_keys(device, monkeypatch):
    """An FP8 index slab gets each token's key quantised as quantize_kv does (the same bytes and
    scale), its scale in the scale slab; the latent slab as before; an all-zero key stays zeros."""
    from wideep_kernels.fp8_kv import dequantize_kv, quantize_kv
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    t, c, rope, kd, num_slots = 5, 64, 16, 32, 24
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(t, c + rope, generator=g).bfloat16().to(device)
    w = (torch.rand(c, generator=g) + 0.5).bfloat16().to(device)
    q = torch.randn(t, 48, generator=g).bfloat16().to(device)
    qw = torch.ones(48, dtype=torch.bfloat16, device=device)
    key = (torch.randn(t, kd, generator=g) * torch.logspace(-3, 3, t)[:, None]).bfloat16().to(device)
    key[2] = 0
    # scale 1 (the row's largest is 448): ties between E4M3 neighbours go to the even one (21 -> 20,
    # 336 -> 320, 3 * 2^-10 -> 2^-8, 2^-10 -> 0), 127.5 carries into the next binade, a tiny
    # negative becomes -0
    ties = torch.tensor([448.0, 21.0, 336.0, 3 * 2 ** -10, 2 ** -10, 127.5, -2 ** -11, -21.0, 0.75 * 2 ** -6])
    key[1] = 0
    key[1, :len(ties)] = ties.bfloat16().to(device)
    _, cos, sin = rope_tables(t, rope, False, device=device)
    slots = torch.tensor([3, 7, 0, 19, 11], device=device)
    slab = torch.zeros(num_slots, c + rope, dtype=torch.bfloat16, device=device)
    key_slab = torch.zeros(num_slots, kd, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.zeros(num_slots, device=device)
    latent, _ = latent_triton(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), (slots, slab, key, key_slab, scales))
    want_q, want_scale = quantize_kv(key)
    assert torch.equal(key_slab[slots].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales[slots], want_scale)
    assert key_slab[7, :8].float().tolist() == [448.0, 20.0, 320.0, 2 ** -8, 0.0, 128.0, -0.0, -20.0]
    assert key_slab[7, 6].view(torch.uint8) == 0x80  # -0
    assert torch.equal(slab[slots], latent)
    assert not key_slab[2].float().any() and int(scales.ne(0).sum()) == t
    ref = (torch.zeros_like(slab), torch.zeros_like(key_slab), torch.zeros_like(scales))
    latent_and_query_reference(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), (slots, *ref[:1], key, *ref[1:]))
    assert torch.equal(ref[1].view(torch.uint8), key_slab.view(torch.uint8)) and torch.equal(ref[2], scales)
    assert (dequantize_kv(key_slab[slots], scales[slots]) - key.float()).abs().max() <= key.float().abs().max() / 8
    with pytest.raises(ValueError, match="FP8 index slab"):
        latent_triton(kv, w, 1e-6, cos, sin, False, (q, qw, 1e-5), (slots, slab, key, key_slab))


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_index_key_bytes_for_every_e4m3_value_and_midpoint(device, monkeypatch):
    """Every finite E4M3 value, every midpoint between neighbours (ties, to even), values just
    either side of them, and both zeros: the latent kernel's bytes are torch's (rows of scale 1)."""
    from wideep_kernels.fp8_kv import quantize_kv
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mids, mids * (1 + 2 ** -6), mids * (1 - 2 ** -6), torch.tensor([-0.0])])
    values = torch.cat([values, -values]).bfloat16().float().unique()
    kd = 32
    per_row = kd - 1
    t = -(-values.numel() // per_row)
    key = torch.zeros(t, kd)
    key[:, 0] = 448.0
    places = (torch.arange(t * kd) % kd != 0).nonzero().squeeze(1)[:values.numel()]
    key.view(-1)[places] = values
    assert int(key.ne(0).sum()) >= values.numel() - 1 + t  # all but the zeros placed, and each 448
    key = key.bfloat16().to(device)
    c, rope = 16, 8
    kv = torch.randn(t, c + rope).bfloat16().to(device)
    w = torch.ones(c, dtype=torch.bfloat16, device=device)
    q = torch.randn(t, 16).bfloat16().to(device)
    _, cos, sin = rope_tables(t, rope, False, device=device)
    slots = torch.arange(t, device=device)
    slab = torch.zeros(t, c + rope, dtype=torch.bfloat16, device=device)
    key_slab = torch.zeros(t, kd, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.zeros(t, device=device)
    latent_triton(kv, w, 1e-6, cos, sin, False, (q, torch.ones_like(q[0]), 1e-5), (slots, slab, key, key_slab, scales))
    want, want_scale = quantize_kv(key)
    assert torch.equal(scales, want_scale) and bool((scales == 1).all())
    assert torch.equal(key_slab.view(torch.uint8), want.view(torch.uint8))
