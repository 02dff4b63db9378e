"""The indexer's top-k selection, side by side: the multi-launch radix passes, and the one-launch
select with rows split over programs that meet at barriers (the built-in split, the same with
every byte pass counted by histograms and with the last two counted by atomics where few keys
match, and spans of 256-2048 positions). Each call is captured 16 times in one CUDA
graph (bench.kernel_timing.graph_ms), so launches and the gaps between them count as they do
in the decode step; every choice must pick the reference's positions.

    python -m bench.probe_select --json select.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_timing import graph_ms
from kernels.indexer import select_topk_reference, select_topk_triton
from kernels.row_select import MAX_PARTS, select_rows

TOPK = 2048
BATCHES = (1, 16, 64)
WIDTHS = (8192, 10240, 16384, 32768)
SPLIT = ((256, 256), (512, 256), (512, 512), (1024, 512), (2048, 512))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    args = ap.parse_args(argv)
    rows = []
    for width in args.widths:
        for batch in args.batches:
            g = torch.Generator(device="cuda").manual_seed(batch * width)
            scores = torch.randn(batch, width, device="cuda", generator=g)
            # about 8K live positions a row, as a context of 8K in a wider graph bucket
            g_lens = torch.full((batch,), min(width, 8193), dtype=torch.int32, device="cuda")
            scores[:, 8193:] = float("-inf")
            want = select_topk_reference(scores, g_lens, TOPK).sort(dim=1).values
            out = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
            k = min(TOPK, width)
            choices = {"radix": lambda: select_topk_triton(scores, g_lens, TOPK, method="radix"),
                       "split": lambda: select_rows(scores, g_lens, out, k),
                       "split_dense": lambda: select_rows(scores, g_lens, out, k, sparse_from=4),
                       "split_sparse": lambda: select_rows(scores, g_lens, out, k, sparse_from=2)}
            for span, block in SPLIT:
                if span < width and -(-width // span) <= MAX_PARTS:
                    choices[f"split_s{span}_b{block}"] = (
                        lambda s=span, b=block: select_rows(scores, g_lens, out, k, span=s, block=b))
            for name, fn in choices.items():
                got = fn()
                if not torch.equal(got.sort(dim=1).values, want):
                    raise SystemExit(f"wrong positions: {name} batch {batch} width {width}")
                us = graph_ms(fn, 3, args.iters, repeat=16) * 1e3
                rows.append(dict(batch=batch, width=width, choice=name, us=round(us, 2)))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| width | batch | " + " | ".join(dict.fromkeys(r["choice"] for r in rows)) + " |")
    for width in args.widths:
        for batch in args.batches:
            cells = [f"{r['us']:.1f}" for r in rows if r["batch"] == batch and r["width"] == width]
            print(f"| {width} | {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
