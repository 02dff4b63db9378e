"""The batch-1 linear kernel (wideep_kernels/gemv.py) against exact products, and where its dispatcher
sends a call."""
import pytest
import torch
import torch.nn.functional as F

from kernel_devices import DEVICES, gemv_close_to_exact as close_to_exact

triton = pytest.importorskip("triton")

from wideep_kernels import gemv as gemv_module  # noqa: E402
from wideep_kernels.gemv import MAX_K, gemv_triton, linear  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(29, 40), (64, 96), (7, 130)])
def test_matches_exact_products(device, dtype, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype).to(device)
    close_to_exact(gemv_triton(x, w), x, w)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_of_a_wider_output_and_a_weight_view(device):
    """x a slice of a wider row (a fused projection's output) and W a row slice of a fused weight."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(1, 70, generator=g).to(torch.bfloat16).to(device)
    fused = (torch.randn(50, 48, generator=g) * 0.1).to(torch.bfloat16).to(device)
    x, w = wide[:, 10:58], fused[7:40]
    close_to_exact(gemv_triton(x, w), x, w)


def test_dispatcher_uses_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = gemv_module.gemv_triton
    monkeypatch.setattr(gemv_module, "gemv_triton", lambda x, w: calls.append(x.shape) or real(x, w))
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(16, 32, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(2, 32, generator=g).to(torch.bfloat16)
    # on CPU only with the interpreter opted in, as every kernel here
    monkeypatch.delenv("WIDEEP_CPU_KERNELS", raising=False)
    assert torch.equal(linear(x[:1], w), F.linear(x[:1], w)) and not calls
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bias = torch.zeros(16, dtype=torch.bfloat16)
    wide_x, wide_w = torch.zeros(1, MAX_K + 1, dtype=torch.bfloat16), torch.zeros(4, MAX_K + 1, dtype=torch.bfloat16)
    for args in ((x, w),                          # two rows
                 (x[:1], w, bias),                # a bias
                 (x[:1].float(), w.float()),      # fp32
                 (x[:0], w),                      # no rows
                 (wide_x, wide_w)):               # K past MAX_K
        assert torch.equal(linear(*args), F.linear(*args))
    assert not calls
    close_to_exact(linear(x[:1], w), x[:1], w)
    assert calls == [(1, 32)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bench_model_shapes_in_a_cuda_graph():
    """The bench model's decode projections (K 2048 and 768) and its LM head, captured in a graph
    behind another kernel and replayed with new inputs."""
    from wideep_kernels.rmsnorm import rms_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((1928, 2048), (3072, 768), (2048, 2048), (32000, 2048)):
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        src = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        linear(rms_norm(src, norm_w, 1e-6), w)  # builds before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            normed = rms_norm(src, norm_w, 1e-6)
            out = linear(normed, w)
        for _ in range(2):
            src.copy_(torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            close_to_exact(out, normed, w)
