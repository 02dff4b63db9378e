"""Where the kernel tests run a kernel, and how closely it must match its reference.

Triton picks its interpreter or the compiler when it is first imported: on a machine without
CUDA, tests/conftest.py turns the interpreter on before anything imports triton (the engine
imports the kernels), and importing this module does the same for a test file run alone.
"""
import os
import sys

import pytest
import torch

IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and not IMPORTED_TOO_EARLY
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRETING, reason="CPU runs Triton only under TRITON_INTERPRET=1, set before triton's first import")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


def within_ulp(out: torch.Tensor, ref: torch.Tensor, ulps: int = 1) -> None:
    """Same dtype, shape, contiguous; fp32 to 1e-6 (absolute and relative: sums added in another
    order move the last bits); bf16/fp16 within `ulps` units in the last place of the reference."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        return
    o, r = out.double(), ref.double()
    ulp = torch.ldexp(torch.ones_like(r), torch.frexp(r)[1] - 1 - MANTISSA_BITS[ref.dtype])
    bad = (o - r).abs() > ulps * ulp
    assert not bad.any(), f"{int(bad.sum())} values off by more than {ulps} ulp, e.g. {o[bad][:4]} vs {r[bad][:4]}"


def poison_empty(monkeypatch) -> None:
    """torch.empty hands out memory full of garbage (NaN, -7) for the rest of the test, as a
    reused CUDA block may be: a kernel that relies on zeroed scratch it did not clear fails."""
    real = torch.empty

    def poisoned(*size, **kw):
        t = real(*size, **kw)
        if t.dtype != torch.bool and t.numel():
            t.fill_(float("nan") if t.is_floating_point() else -7)
        return t
    monkeypatch.setattr(torch, "empty", poisoned)


def gemv_close_to_exact(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out = x @ w.T within one unit in the last place of the exact product rounded, plus fp32
    summation error (bounded by 2^-20 of the sum of |products|: it matters where the products
    cancel)."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    exact = x.double() @ w.double().T
    rounded = exact.to(x.dtype).double()
    ulp = torch.ldexp(torch.ones_like(rounded), torch.frexp(rounded)[1] - 1 - MANTISSA_BITS[x.dtype])
    bound = ulp + 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)
    bad = (out.double() - exact).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} values off, e.g. {out.double()[bad][:4]} vs {exact[bad][:4]}"
