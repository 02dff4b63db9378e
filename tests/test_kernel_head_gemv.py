"""The per-head decode projections (wideep_kernels/head_gemv.py) against exact products, on the
strided views the attention layer passes, and where the dispatcher sends a call."""
import pytest
import torch

from kernel_devices import DEVICES, MANTISSA_BITS

triton = pytest.importorskip("triton")

from wideep_kernels import head_gemv as head_gemv_module  # noqa: E402
from wideep_kernels.head_gemv import MAX_ROWS, head_gemv, head_gemv_reference, head_gemv_triton  # noqa: E402


def close_to_exact(out, x, w):
    """Within one unit in the last place of the exact product rounded, plus fp32 summation error
    (2^-20 of the sum of |products|, which matters where they cancel)."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1], w.shape[2]) and out.is_contiguous()
    exact = torch.einsum("thk,hkn->thn", x.double(), w.double())
    rounded = exact.to(x.dtype).double()
    ulp = torch.ldexp(torch.ones_like(rounded), torch.frexp(rounded)[1] - 1 - MANTISSA_BITS[x.dtype])
    bound = ulp + 2.0 ** -20 * torch.einsum("thk,hkn->thn", x.double().abs(), w.double().abs())
    bad = (out.double() - exact).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} values off, e.g. {out.double()[bad][:4]} vs {exact[bad][:4]}"


def _mla_weights(heads, nope, v, lora, dtype, device, seed=0):
    """kv_b_proj's weight as the attention layer views it: the key rows [H, nope, lora] and the
    value rows transposed [H, lora, v], both views of one [H * (nope + v), lora] matrix."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads * (nope + v), lora, generator=g) * 0.05).to(dtype).to(device)
    w_kv = w.view(heads, nope + v, lora)
    return w_kv[:, :nope], w_kv[:, nope:].transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_query_absorption_and_value_projection_views(device, dtype, rows):
    heads, nope, rope, v, lora = 3, 16, 8, 12, 40  # lora not a power of two: masked tiles
    w_uk, w_uv_t = _mla_weights(heads, nope, v, lora, dtype, device)
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, nope + rope, generator=g).to(dtype).to(device)
    q_nope = q[..., :nope]  # a strided view, as the layer splits the query
    close_to_exact(head_gemv_triton(q_nope, w_uk), q_nope, w_uk)
    latent_out = torch.randn(heads, rows, lora, generator=g).to(dtype).to(device).transpose(0, 1)
    close_to_exact(head_gemv_triton(latent_out, w_uv_t), latent_out, w_uv_t)


def test_dispatcher_uses_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = head_gemv_module.head_gemv_triton
    monkeypatch.setattr(head_gemv_module, "head_gemv_triton", lambda x, w: calls.append(x.shape) or real(x, w))
    w_uk, _ = _mla_weights(2, 8, 8, 16, torch.bfloat16, "cpu")
    x = torch.randn(MAX_ROWS + 1, 2, 8).to(torch.bfloat16)
    monkeypatch.delenv("WIDEEP_CPU_KERNELS", raising=False)
    assert torch.equal(head_gemv(x[:1], w_uk), head_gemv_reference(x[:1], w_uk)) and not calls
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for args in ((x, w_uk),                          # more rows than MAX_ROWS
                 (x[:1].float(), w_uk.float()),      # fp32
                 (x[:0], w_uk)):                     # no rows
        assert torch.equal(head_gemv(*args), head_gemv_reference(*args))
    assert not calls
    close_to_exact(head_gemv(x[:2], w_uk), x[:2], w_uk)
    assert calls == [(2, 2, 8)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 2])
def test_bench_model_shapes_in_a_cuda_graph(rows):
    """The bench model's heads (16, nope 128, value 128, latent 512), captured in a graph behind
    another kernel and replayed with new inputs."""
    w_uk, w_uv_t = _mla_weights(16, 128, 128, 512, torch.bfloat16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(rows, 16, 192, device="cuda", generator=g).to(torch.bfloat16)
    lat = torch.randn(rows, 16, 512, device="cuda", generator=g).to(torch.bfloat16)
    head_gemv(q[..., :128], w_uk), head_gemv(lat, w_uv_t)  # builds before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q2 = q * 2  # a kernel ahead of them in the stream
        a = head_gemv(q2[..., :128], w_uk)
        b = head_gemv(lat, w_uv_t)
    for _ in range(2):
        q.copy_(torch.randn(rows, 16, 192, device="cuda", generator=g).to(torch.bfloat16))
        lat.copy_(torch.randn(rows, 16, 512, device="cuda", generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        close_to_exact(a, q2[..., :128], w_uk)
        close_to_exact(b, lat, w_uv_t)
