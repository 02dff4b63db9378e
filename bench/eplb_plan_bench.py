"""Plan time of the EPLB placement policy at DeepSeek-V4.1-Flash scale, on CPU.

384 routed experts, 40 MoE layers, 8 expert groups, one NVLink domain, two decode widths:
32 ranks x 13 slots (416 slots, 32 redundant) and 72 ranks x 6 slots (432 slots, 48
redundant). Load: per layer, Zipf(s) token shares over the experts in a random order.

"fresh" plans from scratch (the first plan, from the identity placement). "with current"
re-plans the next window, the same load with multiplicative Gaussian noise (--noise), from the
fresh plan, as the controller does every window; it also reports how many slots change.
Imbalance = max rank load / mean rank load under the even replica split, mean over layers;
"scratch" is the imbalance a fresh plan of the same window gets (what stability trades).

    python -m bench.eplb_plan_bench --runs 11
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.eplb_policy import Placement, imbalance, moved_experts, rebalance


def zipf_load(layers: int, experts: int, s: float, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    rows = [base[torch.randperm(experts, generator=g)] for _ in range(layers)]
    return (torch.stack(rows) / base.sum() * tokens).round()


def timed(fn, runs: int) -> tuple[list[float], object]:
    fn()  # warm-up: first numpy calls pay for imports and allocations
    times, out = [], None
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return times, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--layouts", default="32:416,72:432", help="ranks:slots pairs, comma separated")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the expert load")
    ap.add_argument("--noise", type=float, default=0.05, help="relative noise of the next window")
    ap.add_argument("--tokens", type=int, default=8192 * 8, help="tokens x top-k in one window")
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    load = zipf_load(args.layers, args.experts, args.zipf, args.tokens, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    noisy = (load * (1 + args.noise * torch.randn(load.shape, generator=g, dtype=torch.float64))).clamp(min=0).round()

    print(f"{args.layers} layers, {args.experts} experts, {args.groups} groups, 1 domain, "
          f"Zipf s={args.zipf}, next window noise {args.noise:.0%}, {args.runs} runs")
    print("| ranks | slots/rank | plan | median ms | max ms | imbalance before | after | scratch | slots moved |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pair in args.layouts.split(","):
        ranks, slots = (int(x) for x in pair.split(":"))
        kw = dict(num_slots=slots, num_ranks=ranks, num_groups=args.groups)
        ident = Placement.identity(args.layers, args.experts, slots, ranks)
        t_fresh, fresh = timed(lambda: rebalance(load, **kw), args.runs)
        t_cur, nxt = timed(lambda: rebalance(noisy, current=fresh, **kw), args.runs)
        moved = len(moved_experts(fresh, nxt))
        scratch = imbalance(noisy, rebalance(noisy, **kw))
        rows = [
            ("fresh", t_fresh, imbalance(load, ident), imbalance(load, fresh), imbalance(load, fresh), "-"),
            ("with current", t_cur, imbalance(noisy, fresh), imbalance(noisy, nxt), scratch,
             f"{moved} ({moved / (args.layers * slots):.1%})"),
        ]
        for name, t, before, after, best, mv in rows:
            print(f"| {ranks} | {slots // ranks} | {name} | {statistics.median(t):.1f} | {max(t):.1f} | "
                  f"{before.mean():.3f} (max {before.max():.3f}) | {after.mean():.3f} (max {after.max():.3f}) | "
                  f"{best.mean():.3f} (max {best.max():.3f}) | {mv} |")


if __name__ == "__main__":
    main()
