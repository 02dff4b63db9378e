"""Timing and reporting shared by the kernel benchmarks (bench/kernel_*.py): each times a
kernel and its reference side by side on the same inputs and prints a markdown table."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def time_ms(fn, device: str, warmup: int, iters: int, flush: torch.Tensor | None = None) -> float:
    """Median milliseconds of fn(): CUDA events on a GPU (zeroing `flush` first, to empty the L2
    cache), wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(iters):
            if flush is not None:
                flush.zero_()
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


def graph_ms(fn, warmup: int, iters: int, repeat: int = 1) -> float | None:
    """GPU time alone: fn captured in a CUDA graph and replayed (eager timings of small shapes
    mostly measure the host launching kernels). None when fn cannot be captured. `repeat`
    captures fn that many times back to back and returns the time of one: a call of a few
    microseconds is otherwise lost under the replay's own cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and allocate outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                fn()
    except RuntimeError:
        return None
    return time_ms(graph.replay, "cuda", warmup, iters) / repeat


def write_kernel_table(prof, path: str, title: str, row_limit: int = 45) -> int:
    """Append a torch profiler's kernels by device time (CPU ops where it saw none) to `path`
    under a heading of `title`; returns how many kernels it saw."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = "cuda_time_total" if kernels else "cpu_time_total"
    with open(path, "a") as f:
        f.write(f"## {title}: {len(kernels)} kernels, {sum(e.device_time for e in kernels) / 1e3:.3f} ms kernel time\n")
        f.write(prof.key_averages().table(sort_by=by, row_limit=row_limit, max_name_column_width=70) + "\n\n")
    return len(kernels)


def markdown(rows: list[dict], cols: list[str] | None = None) -> str:
    cols = cols or list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def bench_main(run, description: str, cols: list[str] | None = None, argv: list[str] | None = None) -> list[dict]:
    """The command line of a kernel benchmark: --device, --quick (small shapes: a CPU smoke run),
    --json PATH (also write the rows)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small shapes, few iterations (CPU smoke)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    rows = run(args.device, args.quick)
    import triton
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU, TRITON_INTERPRET=1"
    print(f"{where}, torch {torch.__version__}, triton {triton.__version__}")
    print(markdown(rows, cols))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
