"""The k-th-score radix select's launch choices, timed side by side: positions a program counts
(`span`), its loop step (`block`) and warps, for the decode shapes (top-2048 of 8K positions at
batch 1, 16 and 64; 128K at batch 16). Each call is replayed from a CUDA graph; every choice
must find the same k-th scores as torch.topk.

    python -m bench.probe_radix --json radix.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.kernel_timing import graph_ms
from kernels.indexer import kth_scores

TOPK = 2048
SHAPES = ((1, 8192), (16, 8192), (64, 8192), (16, 131072))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    rows = []
    for batch, width in SHAPES:
        scores = torch.randn(batch, width, device="cuda")
        want = torch.topk(scores, TOPK, dim=1).values[:, -1]
        base = graph_ms(lambda: kth_scores(scores, TOPK, "radix"), 3, args.iters)
        for span, block, warps in itertools.product((512, 1024, 2048, 4096, 8192), (256, 512, 1024, 2048), (4, 8)):
            if span % block or span > max(width, 1024):
                continue
            if not torch.equal(kth_scores(scores, TOPK, "radix", span, block, warps), want):
                raise SystemExit(f"wrong k-th score: span {span} block {block} warps {warps}")
            ms = graph_ms(lambda: kth_scores(scores, TOPK, "radix", span, block, warps), 3, args.iters)
            rows.append(dict(batch=batch, width=width, span=span, block=block, num_warps=warps,
                             programs=batch * -(-width // span), us=round(ms * 1e3, 2),
                             built_in_us=round(base * 1e3, 2)))
            print(json.dumps(rows[-1]), flush=True)
        best = min((r for r in rows if r["batch"] == batch and r["width"] == width), key=lambda r: r["us"])
        print(json.dumps(dict(best=True, **best)), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
