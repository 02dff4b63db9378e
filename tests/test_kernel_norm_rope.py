"""RMSNorm and rotary-embedding kernels against their torch references (and the references
against engine/layers.py, whose semantics they copy)."""
import pytest
import torch

from kernel_devices import DEVICES, IMPORTED_TOO_EARLY, within_ulp

triton = pytest.importorskip("triton")
tl = triton.language

from engine.layers import RMSNorm, Rotary  # noqa: E402
from wideep_kernels import rmsnorm as norm_module  # noqa: E402
from wideep_kernels import rope as rope_module  # noqa: E402
from wideep_kernels.rmsnorm import (  # noqa: E402
    add_rms_norm, add_rms_norm_reference, add_rms_norm_triton, rms_norm, rms_norm_reference, rms_norm_triton)
from wideep_kernels.rope import apply_rope, apply_rope_reference, apply_rope_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels natively")
def test_interpreter_is_on():
    assert not IMPORTED_TOO_EARLY, \
        "triton was imported before TRITON_INTERPRET=1 was set; set it in tests/conftest.py before importing engine"
    assert type(norm_module._rms_norm_kernel).__name__ == "InterpretedFunction"
    assert type(rope_module._rope_kernel).__name__ == "InterpretedFunction"


def check(out: torch.Tensor, ref: torch.Tensor, exact: bool = False) -> None:
    """Bit for bit when `exact`; else fp32 to 1e-6, bf16/fp16 within one ulp of the reference."""
    within_ulp(out, ref)
    if exact:
        assert torch.equal(out, ref)


def norm_inputs(shape, dtype, device, seed=0, w_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) * 0.5 + 1
    return x.to(dtype).to(device), w.to(w_dtype or dtype).to(device)


def tables(t, dim, seed=0, device="cpu"):
    """cos/sin rows of the engine's own rotary tables at random positions up to 100K."""
    rot = Rotary(dim, 10000.0, False, 128, "cpu")
    pos = torch.randint(0, 100_000, (t,), generator=torch.Generator().manual_seed(seed))
    rot.ensure(int(pos.max()) if t else 0)
    cos, sin = rot.tables(pos)
    return cos.to(device), sin.to(device)


if triton is not None:
    @triton.jit
    def _cast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(src_ptr + offs, mask=offs < n)
        tl.store(dst_ptr + offs, norm_module.cast_rne(v, dst_ptr.dtype.element_ty), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 3.4e38 -> fp16 inf, in numpy
@pytest.mark.parametrize("device", DEVICES)
def test_cast_rounds_to_nearest_even(device):
    # Ties both ways (to the even neighbour below and above), carries into the exponent,
    # subnormals, infinities, NaN, and plain random values.
    ties = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), -(1.0 + 3 * 2 ** -8), 2.0 - 2 ** -9,
            3 * 2 ** -135, 2 ** -133, 1e-40, float("inf"), -float("inf"), 3.4e38, 0.0, -0.0]
    g = torch.Generator().manual_seed(0)
    src = torch.cat([torch.tensor(ties), torch.randn(200, generator=g) * 100]).to(device)
    for dtype in (torch.bfloat16, torch.float16):
        dst = torch.empty(src.shape, dtype=dtype, device=device)
        _cast_kernel[(1,)](src, dst, src.numel(), BLOCK=256)
        assert torch.equal(dst.view(torch.int16), src.to(dtype).view(torch.int16))
    # NaNs whose payload sits in the low bits only (rounding alone would make them inf, or wrap).
    nan = torch.tensor([0x7FC00000, 0x7F800001, -1, 0x7F80FFFF], dtype=torch.int32).view(torch.float32).to(device)
    dst = torch.empty(4, dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](nan, dst, 4, BLOCK=4)
    assert dst.isnan().all()


# ---- RMSNorm ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 1), (1, 7), (3, 33), (2, 3, 64), (5, 768)])
def test_rms_norm_matches_reference(device, dtype, shape):
    x, w = norm_inputs(shape, dtype, device, seed=shape[-1])
    check(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 33), (2, 3, 64), (5, 768)])
def test_add_rms_norm_matches_reference(device, dtype, shape):
    """The residual add folded into the norm: h exactly torch's x + residual (same rounding),
    the norm of h as the unfused norm computes it."""
    x, w = norm_inputs(shape, dtype, device, seed=shape[-1])
    r, _ = norm_inputs(shape, dtype, device, seed=shape[-1] + 1)
    out, h = add_rms_norm_triton(x, r, w, 1e-6)
    ref_out, ref_h = add_rms_norm_reference(x, r, w, 1e-6)
    check(h, ref_h, exact=True)
    check(out, ref_out)
    check(out, rms_norm_triton(ref_h, w, 1e-6), exact=True)  # the same kernel arithmetic on h


def test_add_rms_norm_dispatch_and_module():
    """The module's two forms and the dispatcher's reference path (CPU tensors, kernels off)."""
    norm = RMSNorm(16)
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    out, h = norm(x, r)
    assert torch.equal(h, x + r) and torch.equal(out, norm(x + r))
    assert torch.equal(add_rms_norm(x, r, norm.weight.detach(), norm.eps)[0], out.detach())
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm_triton(x, r[:2], norm.weight.detach(), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_mixed_dtypes(device):
    # An fp32 weight on a bf16 activation: the reference's product (and so the output) is fp32.
    x, w = norm_inputs((3, 40), torch.bfloat16, device, w_dtype=torch.float32)
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == torch.float32
    check(out, rms_norm_reference(x, w, 1e-6))
    x16, w16 = norm_inputs((3, 40), torch.float16, device, w_dtype=torch.bfloat16)
    check(rms_norm_triton(x16, w16, 1e-6), rms_norm_reference(x16, w16, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_strided(device, dtype):
    # c_kv is the first kv_lora columns of a wider projection: rows strided, not copied.
    wide, w = norm_inputs((4, 40), dtype, device)
    w = w[:32].contiguous()
    x = wide[:, :32]
    keep = wide.clone()
    check(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    assert torch.equal(wide, keep)
    # Leading dims that do not collapse to one stride take a copy.
    x3 = norm_inputs((3, 4, 16), dtype, device, seed=1)[0].transpose(0, 1)
    w3 = w[:16].contiguous()
    check(rms_norm_triton(x3, w3, 1e-6), rms_norm_reference(x3, w3, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,block_d", [(50, 16), (64, 16), (8192, None), (8200, None)])
def test_rms_norm_chunked_and_wide(device, dtype, d, block_d):
    x, w = norm_inputs((2, d), dtype, device, seed=d)
    check(rms_norm_triton(x, w, 1e-6, block_d=block_d), rms_norm_reference(x, w, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_eps_zero_rows_and_empty(device):
    x, w = norm_inputs((3, 24), torch.float32, device)
    x[1] = 0  # rsqrt(eps) * 0: zeros, not NaN
    for eps in (1e-6, 0.5):
        check(rms_norm_triton(x, w, eps), rms_norm_reference(x, w, eps))
    assert torch.equal(rms_norm_triton(x, w, 1e-6)[1], torch.zeros(24, device=device))
    for shape in ((0, 16), (2, 0, 16)):
        e, we = norm_inputs(shape, torch.bfloat16, device)
        out = rms_norm_triton(e, we, 1e-6)
        assert out.shape == shape and out.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        rms_norm_triton(x, w[:10], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reference_is_the_engine(dtype):
    x, w = norm_inputs((3, 5, 48), dtype, "cpu")
    mod = RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        mod.weight.copy_(w)
        assert torch.equal(mod(x), rms_norm_reference(x, w, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_dispatcher(device, monkeypatch):
    x, w = norm_inputs((3, 32), torch.bfloat16, device)
    ref = rms_norm_reference(x, w, 1e-6)
    calls = []
    real = norm_module.rms_norm_triton
    monkeypatch.setattr(norm_module, "rms_norm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")  # CPU tensors take the (interpreted) kernel only when asked
    check(rms_norm(x, w, 1e-6), ref)
    assert calls == [1]
    # Autograd and dtypes the kernel does not take stay on the reference.
    rms_norm(x, w.clone().requires_grad_(), 1e-6)
    rms_norm(x.double(), w.double(), 1e-6)
    assert calls == [1]
    if device == "cpu":
        monkeypatch.delenv("WIDEEP_CPU_KERNELS")
        assert torch.equal(rms_norm(x, w, 1e-6), ref)
        assert calls == [1]


# ---- rotary embedding ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("shape", [(1, 4, 8), (3, 5, 12), (4, 8), (2, 2, 3, 8)])
def test_rope_matches_reference(device, dtype, interleave, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=g) * 2).to(dtype).to(device)
    cos, sin = tables(shape[0], shape[-1], device=device)
    check(apply_rope_triton(x, cos, sin, interleave), apply_rope_reference(x, cos, sin, interleave),
          exact=device == "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [False, True])
def test_rope_strided(device, dtype, interleave):
    g = torch.Generator().manual_seed(3)
    t, h, nope, rope = 3, 5, 16, 8
    cos, sin = tables(t, rope, device=device)
    exact = device == "cpu"
    # The rope slice of q [T, H, nope + rope], its heads also split over programs.
    q = torch.randn(t, h, nope + rope, generator=g).to(dtype).to(device)
    keep = q.clone()
    q_rope = q[..., nope:]
    ref = apply_rope_reference(q_rope, cos, sin, interleave)
    check(apply_rope_triton(q_rope, cos, sin, interleave), ref, exact)
    check(apply_rope_triton(q_rope, cos, sin, interleave, block_h=2), ref, exact)
    assert torch.equal(q, keep)
    # The rope tail of the latent projection [T, kv_lora + rope].
    kv = torch.randn(t, 32 + rope, generator=g).to(dtype).to(device)
    k_rope = kv[:, 32:]
    check(apply_rope_triton(k_rope, cos, sin, interleave), apply_rope_reference(k_rope, cos, sin, interleave), exact)
    # Heads outer in memory (token stride smaller than the head stride).
    xt = torch.randn(h, t, rope, generator=g).to(dtype).to(device).transpose(0, 1)
    check(apply_rope_triton(xt, cos, sin, interleave), apply_rope_reference(xt, cos, sin, interleave), exact)
    # Middle dims that do not collapse to one stride take a copy.
    x4 = torch.randn(2, t, 3, rope, generator=g).to(dtype).to(device).transpose(0, 1)
    check(apply_rope_triton(x4, cos, sin, interleave), apply_rope_reference(x4, cos, sin, interleave), exact)
    # Tables that are column slices of wider ones.
    wide_cos, wide_sin = torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)
    check(apply_rope_triton(q_rope, wide_cos[:, :rope // 2], wide_sin[:, :rope // 2], interleave), ref, exact)


@pytest.mark.parametrize("device", DEVICES)
def test_rope_empty_and_errors(device):
    cos, sin = tables(0, 8, device=device)
    x = torch.zeros(0, 4, 8, dtype=torch.bfloat16, device=device)
    out = apply_rope_triton(x, cos, sin, True)
    assert out.shape == (0, 4, 8) and out.dtype == torch.bfloat16
    cos, sin = tables(2, 8, device=device)
    with pytest.raises(ValueError):
        apply_rope_triton(torch.zeros(2, 4, 7, device=device), cos, sin, False)  # odd rotary dim
    with pytest.raises(ValueError):
        apply_rope_triton(torch.zeros(3, 4, 8, device=device), cos, sin, False)  # table rows != tokens
    with pytest.raises(ValueError):
        apply_rope_triton(torch.zeros(2, 4, 8, device=device), cos.double(), sin.double(), False)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_reference_is_the_engine(interleave, dtype):
    rot = Rotary(16, 10000.0, interleave, 64, "cpu")
    pos = torch.tensor([0, 5, 63])
    cos, sin = rot.tables(pos)
    x = torch.randn(3, 4, 24).to(dtype)[..., 8:]
    assert torch.equal(rot.apply(x, cos, sin), apply_rope_reference(x, cos, sin, interleave))


@pytest.mark.parametrize("device", DEVICES)
def test_rope_dispatcher(device, monkeypatch):
    x = torch.randn(3, 2, 8).to(torch.bfloat16).to(device)
    cos, sin = tables(3, 8, device=device)
    ref = apply_rope_reference(x, cos, sin, True)
    calls = []
    real = rope_module.apply_rope_triton
    monkeypatch.setattr(rope_module, "apply_rope_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    check(apply_rope(x, cos, sin, True), ref, exact=device == "cpu")
    assert calls == [1]
    apply_rope(x.float().requires_grad_(), cos, sin, True)
    apply_rope(x, cos.double(), sin.double(), True)
    assert calls == [1]
    if device == "cpu":
        monkeypatch.delenv("WIDEEP_CPU_KERNELS")
        assert torch.equal(apply_rope(x, cos, sin, True), ref)
        assert calls == [1]


def test_a_kernel_that_cannot_run_here_falls_back_once(monkeypatch, caplog):
    """A Triton kernel that fails to build or launch (a Triton release it was not checked on)
    must not take the engine down: warn once, then the reference answers."""
    import wideep_kernels
    import wideep_kernels.rmsnorm as mod
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PTX assembly failed")
    monkeypatch.setattr(mod, "triton_ok", lambda t: True)
    monkeypatch.setattr(mod, "rms_norm_triton", broken)
    monkeypatch.setattr(wideep_kernels, "_unusable", set())
    x, w = torch.randn(3, 16), torch.randn(16)
    with caplog.at_level("WARNING"):
        out1 = mod.rms_norm(x, w, 1e-6)
        out2 = mod.rms_norm(x, w, 1e-6)
    assert calls == [1]  # tried once, not on every call
    torch.testing.assert_close(out1, mod.rms_norm_reference(x, w, 1e-6))
    torch.testing.assert_close(out2, out1)
    assert "rms_norm" in caplog.text and "reference" in caplog.text
    monkeypatch.setattr(mod, "rms_norm_triton", lambda *a: (_ for _ in ()).throw(ValueError("bad shape")))
    monkeypatch.setattr(wideep_kernels, "_unusable", set())
    with pytest.raises(ValueError):  # argument errors are the caller's, not a reason to fall back
        mod.rms_norm(x, w, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_rms_norm_rounds_an_fp32_sum_first(device, dtype, monkeypatch):
    """An fp32 x (the routed experts' unrounded sum) on a 16-bit residual: exactly what rounding x
    to the residual's dtype and then calling add_rms_norm gives, in one launch."""
    from wideep_kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, add_rms_norm_triton
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(5, 96, generator=g) * 4).to(device)
    residual = torch.randn(5, 96, generator=g).to(dtype).to(device)
    w = (torch.randn(96, generator=g) * 0.3 + 1).to(dtype).to(device)
    want = add_rms_norm_triton(x.to(dtype), residual, w, 1e-6)
    got = add_rms_norm_triton(x, residual, w, 1e-6)
    assert got[1].dtype == dtype and got[0].dtype == dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = add_rms_norm_reference(x, residual, w, 1e-6)
    assert torch.equal(ref[1], want[1])
    within_ulp(got[0], ref[0])
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    assert torch.equal(add_rms_norm(x, residual, w, 1e-6)[1], want[1])
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm_triton(x.to(dtype), residual.float(), w, 1e-6)
