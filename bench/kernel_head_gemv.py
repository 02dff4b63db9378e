"""The per-head decode projections of MLA (wideep_kernels/head_gemv.py) against the torch calls they
replace (the batched GEMMs of cuBLAS), at the bench model's sizes (bf16): the query absorbed
into the latent space (q_nope [T, 16, 128], a view of q [T, 16, 192], by kv_b_proj's key rows
[16, 128, 512]) and the value up-projection (the latent output [T, 16, 512] by the value rows
[16, 512, 128], a transposed view). graph columns replay a CUDA graph of 20 calls and give one
call's GPU time; the kernel's dependent launch does not show here (each call's inputs are the
same). Each row also checks the kernel's output against the reference.

    python -m bench.kernel_head_gemv --device cuda
    python -m bench.kernel_head_gemv --device cpu --quick      # TRITON_INTERPRET=1 smoke
"""
from __future__ import annotations

import os

import torch

from bench.kernel_timing import bench_main, graph_ms

HEADS, NOPE, ROPE, V, LORA = 16, 128, 64, 128, 512


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton
    from wideep_kernels.head_gemv import head_gemv_triton

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(HEADS * (NOPE + V), LORA, generator=g) * 0.05).to(dtype).to(device).view(HEADS, NOPE + V, LORA)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    rows = []
    for t in ([1, 2] if quick else [1, 2, 4, 8, 16, 32]):
        q = torch.randn(t, HEADS, NOPE + ROPE, generator=g).to(dtype).to(device)
        lat = torch.randn(t, HEADS, LORA, generator=g).to(dtype).to(device)
        heads_out = torch.empty(t, HEADS, V, dtype=dtype, device=device)
        cases = {
            "absorb": (lambda: torch.einsum("thd,hdc->thc", q[..., :NOPE], w_uk),
                       lambda: head_gemv_triton(q[..., :NOPE], w_uk)),
            "value": (lambda: torch.bmm(lat.transpose(0, 1), w_uv.transpose(1, 2), out=heads_out.transpose(0, 1))
                      .transpose(0, 1),
                      lambda: head_gemv_triton(lat, w_uv.transpose(1, 2))),
        }
        for name, (ref, ours) in cases.items():
            want = ref().clone()
            got = ours()
            row = dict(op=name, rows=t, max_abs_err=float((got.float() - want.float()).abs().max()))
            if device.startswith("cuda"):
                row["torch_graph_us"] = graph_ms(ref, 10, 50, repeat=20) * 1e3
                row["ours_graph_us"] = graph_ms(ours, 10, 50, repeat=20) * 1e3
                row["speedup"] = row["torch_graph_us"] / row["ours_graph_us"]
            rows.append(row)
    return rows


if __name__ == "__main__":
    bench_main(run, __doc__.split("\n")[0])
