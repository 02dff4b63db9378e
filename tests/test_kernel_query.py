"""The absorbed-query kernel (kernels/query.py) against the torch expressions it replaces."""
import pytest
import torch

from kernel_devices import DEVICES, IMPORTED_TOO_EARLY

triton = pytest.importorskip("triton")

from kernels import query as query_module  # noqa: E402
from kernels.query import BLOCK_T, absorb_query, absorb_query_reference, absorb_query_triton  # noqa: E402
from kernels.rope import apply_rope_reference  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA runs the kernels natively")
def test_interpreter_is_on():
    assert not IMPORTED_TOO_EARLY
    assert type(query_module._absorb_kernel).__name__ == "InterpretedFunction"


def make_case(t, heads, nope, rope, c, v, dtype, device, seed=0):
    """q as the model has it (a view of the q_b projection's output), w_uk a strided view of
    kv_b_proj's weight, the rope tables of made-up positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads * (nope + rope), generator=g).to(device, dtype).view(t, heads, nope + rope)
    w_kv = (torch.randn(heads * (nope + v), c, generator=g) * nope ** -0.5).to(device, dtype)
    w_uk = w_kv.view(heads, nope + v, c)[:, :nope]
    pos = torch.randint(0, 5000, (t,), generator=g).float()
    freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, rope, 2).float() / rope))
    return q, w_uk, freqs.cos().to(device), freqs.sin().to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 5, BLOCK_T + 6])  # past one row of programs' tokens
@pytest.mark.parametrize("interleave", [True, False])
def test_matches_reference(device, dtype, t, interleave):
    q, w_uk, cos, sin = make_case(t, 4, 32, 16, 96, 24, dtype, device)  # C = 96: a partial column block
    lat, rope = absorb_query_triton(q, w_uk, cos, sin, interleave)
    want_lat = torch.einsum("thd,hdc->thc", q[..., :32].float(), w_uk.float())
    want_rope = apply_rope_reference(q[..., 32:], cos, sin, interleave)
    assert lat.dtype == rope.dtype == dtype and lat.shape == (t, 4, 96) and rope.shape == (t, 4, 16)
    assert torch.equal(rope, want_rope)  # the rotation is rounded as the rope kernel rounds it
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lat.float(), want_lat, **tol)
    assert lat.abs().max() > 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_bench_model_shape(device):
    """16 heads, 128 + 64 query dims, a 512-wide latent: the shape the decode step runs."""
    q, w_uk, cos, sin = make_case(3, 16, 128, 64, 512, 128, torch.float32, device)
    lat, rope = absorb_query_triton(q, w_uk, cos, sin, True)
    want_lat, want_rope = absorb_query_reference(q, w_uk, cos, sin, True)
    torch.testing.assert_close(lat, want_lat, atol=1e-4, rtol=1e-5)
    assert torch.equal(rope, want_rope)


def test_bad_shapes_are_refused():
    q, w_uk, cos, sin = make_case(2, 4, 32, 16, 64, 24, torch.float32, "cpu")
    with pytest.raises(ValueError, match="w_uk"):
        absorb_query_triton(q, w_uk[:3], cos, sin, True)
    with pytest.raises(ValueError, match="cos and sin"):
        absorb_query_triton(q, w_uk, cos[:1], sin[:1], True)


def test_dispatcher_keeps_the_torch_expressions_off_the_kernel_path(monkeypatch):
    """Where the kernel does not run (a CPU tensor without WIDEEP_CPU_KERNELS), the model gets
    exactly the torch expressions it had."""
    monkeypatch.delenv("WIDEEP_CPU_KERNELS", raising=False)
    q, w_uk, cos, sin = make_case(3, 4, 32, 16, 64, 24, torch.float32, "cpu")
    lat, rope = absorb_query(q, w_uk, cos, sin, False)
    assert torch.equal(lat, torch.einsum("thd,hdc->thc", q[..., :32], w_uk))
    assert torch.equal(rope, apply_rope_reference(q[..., 32:], cos, sin, False))
