"""The top-p kernel alone against another version of it, side by side in one process.

    python -m bench.nucleus_ab --other wideep_kernels.nucleus_old --batches 1 16 64 --vocab 129280

`--other` names a module with the same `nucleus_threshold_triton` (the file of an earlier tree,
copied beside the package). Each batch's rows are random logits (normal, times --scale); both
kernels run from CUDA graphs, in turns, and the medians of --iters replays are reported, with
the rows where the two thresholds differ and the rows where each differs from the cut of sums in
fp64 (the exact one: the sort's running fp32 sum drifts over a wide row). `--per-program K ...`
also times this version with each row's chunks added up K to a program (its choice:
`nucleus.chunks_per_program`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics

import torch

from wideep_kernels import nucleus


def fp64_threshold(x: torch.Tensor, top_p: float) -> torch.Tensor:
    ordered = x.double().sort(-1, descending=True).values
    probs = ordered.softmax(-1)
    kept = ((probs.cumsum(-1) - probs) < top_p).sum(-1, keepdim=True).clamp(min=1)
    return ordered.gather(1, kept - 1).squeeze(1).float()


def graph_of(fn, *args) -> torch.cuda.CUDAGraph:
    fn(*args)  # builds the kernels outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    return g


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1000


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--other", required=True, help="module path of the other version")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--per-program", type=int, nargs="*", default=[], metavar="K")
    ap.add_argument("--json", help="append one JSON line per batch here")
    args = ap.parse_args(argv)
    other = importlib.import_module(args.other)
    torch.manual_seed(0)
    print("| batch | this us | other us | this / other | rows differing | this vs fp64 | other vs fp64 |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batches:
        x = torch.randn(batch, args.vocab, device="cuda") * args.scale
        floor = torch.full((batch,), float("-inf"), device="cuda")
        p = torch.full((batch,), args.top_p, device="cuda")
        exact = fp64_threshold(x, args.top_p)
        mine, theirs = nucleus.nucleus_threshold_triton(x, floor, p), other.nucleus_threshold_triton(x, floor, p)
        g_mine, g_theirs = graph_of(nucleus.nucleus_threshold_triton, x, floor, p), \
            graph_of(other.nucleus_threshold_triton, x, floor, p)
        t_mine, t_theirs = [], []
        for _ in range(args.iters):
            t_mine.append(replay_us(g_mine))
            t_theirs.append(replay_us(g_theirs))
        swept = {}
        chosen = nucleus.chunks_per_program
        for k in args.per_program:
            nucleus.chunks_per_program = lambda rows, chunks, k=k: min(k, chunks)
            try:
                g = graph_of(nucleus.nucleus_threshold_triton, x, floor, p)
                swept[k] = statistics.median(replay_us(g) for _ in range(args.iters))
            finally:
                nucleus.chunks_per_program = chosen
        rec = {"batch": batch, "vocab": args.vocab, "this_us": statistics.median(t_mine),
               "chunks_per_program": chosen(batch, -(-args.vocab // nucleus._BLOCK)), "swept_us": swept,
               "other_us": statistics.median(t_theirs), "rows_differing": int((mine != theirs).sum()),
               "this_vs_fp64": int((mine != exact).sum()), "other_vs_fp64": int((theirs != exact).sum())}
        print(f"| {batch} | {rec['this_us']:.1f} | {rec['other_us']:.1f} | {rec['this_us'] / rec['other_us']:.2f} | "
              f"{rec['rows_differing']} | {rec['this_vs_fp64']} | {rec['other_vs_fp64']} |", flush=True)
        if swept:
            print(f"  batch {batch}, chosen {rec['chunks_per_program']} chunks a program; us by chunks a program: "
                  + ", ".join(f"{k}: {v:.1f}" for k, v in swept.items()), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
