"""The split-K decode GEMM (kernels/skinny_gemm.py) against F.linear."""
import pytest
import torch

from kernel_devices import DEVICES

pytest.importorskip("triton")

from kernels import skinny_gemm  # noqa: E402
from kernels.skinny_gemm import Workspace, linear, skinny_linear  # noqa: E402

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,split,block_n,block_k", [
    (1, 48, 96, 1, 16, 32), (5, 40, 200, 3, 16, 32), (16, 64, 256, 4, 32, 64), (33, 50, 130, 8, 16, 16)])
def test_matches_linear_and_leaves_the_workspace_zero(device, dtype, m, n, k, split, block_n, block_k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
    ws = Workspace(n, torch.device(device))
    for call in range(3):  # each call must start from the zeroed workspace the last one left
        x = torch.randn(m, k, generator=g).to(device, dtype)
        got = skinny_linear(x, w, block_n, block_k, split, ws=ws)
        want = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
        assert int(ws.counts.abs().sum()) == 0 and float(ws.sums.abs().sum()) == 0.0
    # a strided x (a column slice of a wider tensor) reads right too
    wide = torch.randn(m, k + 8, generator=g).to(device, dtype)
    torch.testing.assert_close(skinny_linear(wide[:, 8:], w, block_n, block_k, split, ws=ws).float(),
                               torch.nn.functional.linear(wide[:, 8:].float(), w.float()).to(dtype).float(), **TOL[dtype])


def test_bad_shapes_are_refused():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="rows of width"):
        skinny_linear(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="rows of width"):
        skinny_linear(torch.randn(skinny_gemm.MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="block_n"):
        skinny_linear(torch.randn(2, 64), w, block_n=8)


def test_linear_is_f_linear_without_a_measured_win():
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert skinny_gemm.tune_key(1, 8, 16) == "m1|n8|k16" and skinny_gemm.tune_key(40, 8, 16) == "m64|n8|k16"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_cuda_graph_replays_keep_the_workspace_zero():
    w = torch.randn(2048, 768, device="cuda", dtype=torch.bfloat16) / 30
    x = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    ws = Workspace(2048, torch.device("cuda"))
    skinny_linear(x, w, 32, 128, 4, ws=ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, 32, 128, 4, ws=ws)
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y.float(), (x.float() @ w.float().T), atol=3e-2, rtol=3e-2)
    torch.cuda.synchronize()
    assert int(ws.counts.abs().sum()) == 0 and float(ws.sums.abs().sum()) == 0.0
