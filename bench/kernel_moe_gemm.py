"""Fused MoE expert GEMM (Triton) vs the per-slot loop and torch._grouped_mm, on the same pairs.

Shapes: the bench model (H=2048, I=768, 64 slots, top-6) at decode batches of 16..256 tokens
and prefill chunks of 2048 and 8192 tokens; DeepSeek-V3-like layers (H=7168, I=2048, 32 local
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

import argparse
import json
import os
import statistics
import time

import torch

BENCH_MODEL = dict(name="bench", hidden=2048, inter=768, slots=64, top_k=6)
DEEPSEEK_V3 = dict(name="dsv3", hidden=7168, inter=2048, slots=32, top_k=8)
TINY = dict(name="tiny", hidden=64, inter=32, slots=8, top_k=2)


def cases(quick: bool) -> list[dict]:
    if quick:
        return [dict(TINY, tokens=t) for t in (5, 33)]
    return ([dict(BENCH_MODEL, tokens=t) for t in (16, 32, 64, 128, 256, 2048, 8192)]
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


def time_eager(fn, device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_graph(fn, warmup: int, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_eager(graph.replay, "cuda", warmup, iters)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first Triton launch
    from kernels.moe_gemm import (
        fused_experts_grouped_mm, fused_experts_reference, fused_experts_triton, grouped_mm_available,
        pick_config,
    )

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
        timings = {"ref": time_eager(lambda: fused_experts_reference(*args), device, warmup, iters)}
        if grouped_mm_available(args[0], args[1]):
            row["err_grouped_mm"] = relative_error(fused_experts_grouped_mm(*args), ref)
            timings["grouped_mm"] = time_eager(lambda: fused_experts_grouped_mm(*args), device, warmup, iters)
        timings["triton"] = time_eager(lambda: fused_experts_triton(*args), device, warmup, iters)
        row["ref_ms"] = timings["ref"]
        row["grouped_mm_ms"] = timings.get("grouped_mm")
        row["triton_ms"] = timings["triton"]
        row["speedup"] = timings["ref"] / timings["triton"]
        if "grouped_mm" in timings:
            row["vs_grouped_mm"] = timings["grouped_mm"] / timings["triton"]
        row["best"] = min(timings, key=timings.get)
        row["triton_tflops"] = flops / timings["triton"] / 1e9
        if cuda:
            row["triton_graph_ms"] = time_graph(lambda: fused_experts_triton(*args), warmup, iters)
            if "grouped_mm" in timings:
                row["grouped_mm_graph_ms"] = time_graph(lambda: fused_experts_grouped_mm(*args), warmup, iters)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few iterations (CPU smoke)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args()
    rows = run(args.device, args.quick)
    if args.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(markdown(rows))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
