"""The k-th-score radix select's launch choices, timed side by side: positions a program counts
(`span`), its loop step (`block`) and warps, for the decode shapes (top-2048 of 8K positions at
batch 1, 16 and 64; 128K at batch 16; `--shapes` others, e.g. 1x524288). Each call is replayed
from a CUDA graph; every choice must find the same k-th scores as torch.topk.

    python -m bench.probe_radix --json radix.jsonl
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

import wideep_kernels.radix_select
from bench.kernel_timing import graph_ms
from wideep_kernels.indexer import kth_scores

TOPK = 2048
SHAPES = ((1, 8192), (16, 8192), (64, 8192), (16, 131072))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--shapes", nargs="+", default=None, help="BATCHxWIDTH rows to time instead of the decode shapes")
    ap.add_argument("--sparse", action="store_true",
                    help="time each choice with the last two passes' atomics for sparse blocks on and off "
                         "(wideep_kernels/radix_select.py RADIX_SPARSE)")
    args = ap.parse_args(argv)
    sparse_modes = (True, False) if args.sparse else (wideep_kernels.radix_select.RADIX_SPARSE,)
    shapes = [tuple(map(int, s.lower().split("x"))) for s in args.shapes] if args.shapes else SHAPES
    rows = []
    for batch, width in shapes:
        scores = torch.randn(batch, width, device="cuda")
        want = torch.topk(scores, TOPK, dim=1).values[:, -1]
        base = graph_ms(lambda: kth_scores(scores, TOPK, "radix"), 3, args.iters)
        for span, block, warps, sparse in itertools.product(
                (512, 1024, 2048, 4096, 8192, 16384), (256, 512, 1024, 2048), (4, 8), sparse_modes):
            if span % block or span > max(width, 1024):
                continue
            wideep_kernels.radix_select.RADIX_SPARSE = sparse
            if not torch.equal(kth_scores(scores, TOPK, "radix", span, block, warps), want):
                raise SystemExit(f"wrong k-th score: span {span} block {block} warps {warps} sparse {sparse}")
            ms = graph_ms(lambda: kth_scores(scores, TOPK, "radix", span, block, warps), 3, args.iters)
            rows.append(dict(batch=batch, width=width, span=span, block=block, num_warps=warps, sparse=sparse,
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
