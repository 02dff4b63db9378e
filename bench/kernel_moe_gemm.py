"""Fused MoE expert GEMM (Triton) vs the per-slot loop and torch._grouped_mm, on the same pairs.

Shapes: the bench model (H=2048, I=768, 64 slots, top-6) at decode batches of 16..256 tokens
and prefill chunks of 512 to 8192 tokens; DeepSeek-V3-like layers (H=7168, I=2048, 32 local
slots, top-8) at 64 and 256 tokens. Routing: each token picks top_k distinct slots at random
(close to a balanced load). bf16 on CUDA.

eager columns time one call from the host (launches included); graph columns replay a CUDA
graph of one call (the per-slot loop reads counts back to the host and cannot be captured).
Median over the iterations, CUDA events. Every row also checks the Triton result (and the
grouped GEMM's) against the reference on the same inputs: err = max |out - ref| / max |ref|.

    python -m bench.kernel_moe_gemm --device cuda --json bench/out/kernel_moe_gemm.json
    python -m bench.kernel_moe_gemm --device cpu --quick      # TRITON_INTERPRET=1 smoke
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from bench.kernel_timing import bench_main, graph_ms, time_ms

BENCH_MODEL = dict(name="bench", hidden=2048, inter=768, slots=64, top_k=6)
DEEPSEEK_V3 = dict(name="dsv3", hidden=7168, inter=2048, slots=32, top_k=8)
TINY = dict(name="tiny", hidden=64, inter=32, slots=8, top_k=2)


def cases(quick: bool) -> list[dict]:
    if quick:
        return [dict(TINY, tokens=t) for t in (5, 33)]
    return ([dict(BENCH_MODEL, tokens=t) for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 8192)]
            + [dict(DEEPSEEK_V3, tokens=t) for t in (64, 256)])


def make_inputs(case: dict, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t, h, i, s, k = case["tokens"], case["hidden"], case["inter"], case["slots"], case["top_k"]
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(s, 2 * i, h, generator=g) * h ** -0.5
    w2 = torch.randn(s, h, i, generator=g) * i ** -0.5
    slot_of = torch.rand(t, s, generator=g).topk(k, dim=1).indices.flatten()
    token_of = torch.arange(t).repeat_interleave(k)
    weight_of = torch.rand(t * k, generator=g) / k
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
            token_of.to(device), slot_of.to(device), weight_of.to(device))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def grouped_mm_available(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """torch._grouped_mm runs on CUDA only in bf16 on Hopper or newer, and wants 16-byte rows."""
    if not hasattr(torch, "_grouped_mm") or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if w13.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    return x.shape[-1] % 8 == 0 and w13.shape[1] % 16 == 0


def fused_experts_grouped_mm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, token_of: torch.Tensor,
                             slot_of: torch.Tensor, weight_of: torch.Tensor) -> torch.Tensor:
    """The second baseline: torch's grouped GEMM, as engine/moe.py uses it."""
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=x.device).scatter_add_(
        0, slot_of, torch.ones_like(slot_of))
    order = slot_of.argsort(stable=True)
    tokens = token_of[order]
    offs = counts.cumsum(0).to(torch.int32)
    gate, up = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)
    y = y.float() * weight_of[order].float()[:, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, y)
    return out.to(x.dtype)


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first Triton launch
    from wideep_kernels.moe_gemm import fused_experts_reference, fused_experts_triton, pick_config

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    warmup, iters = (1, 3) if quick else (5, 25)
    rows = []
    for case in cases(quick):
        args = make_inputs(case, device, dtype)
        pairs = args[3].numel()
        flops = 6 * pairs * case["hidden"] * case["inter"]
        ref = fused_experts_reference(*args)
        row = {
            "name": case["name"], "T": case["tokens"], "H": case["hidden"], "I": case["inter"],
            "S": case["slots"], "top_k": case["top_k"], "pairs": pairs,
            "block_m": pick_config(pairs, case["slots"], dtype).block_m,
            "err_triton": relative_error(fused_experts_triton(*args), ref),
        }
        timings = {"ref": time_ms(lambda: fused_experts_reference(*args), device, warmup, iters)}
        if grouped_mm_available(args[0], args[1]):
            row["err_grouped_mm"] = relative_error(fused_experts_grouped_mm(*args), ref)
            timings["grouped_mm"] = time_ms(lambda: fused_experts_grouped_mm(*args), device, warmup, iters)
        timings["triton"] = time_ms(lambda: fused_experts_triton(*args), device, warmup, iters)
        row["ref_ms"] = timings["ref"]
        row["grouped_mm_ms"] = timings.get("grouped_mm")
        row["triton_ms"] = timings["triton"]
        row["speedup"] = timings["ref"] / timings["triton"]
        if "grouped_mm" in timings:
            row["vs_grouped_mm"] = timings["grouped_mm"] / timings["triton"]
        row["best"] = min(timings, key=timings.get)
        row["triton_tflops"] = flops / timings["triton"] / 1e9
        if cuda:
            row["triton_graph_ms"] = graph_ms(lambda: fused_experts_triton(*args), warmup, iters)
            if "grouped_mm" in timings:
                row["grouped_mm_graph_ms"] = graph_ms(lambda: fused_experts_grouped_mm(*args), warmup, iters)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
