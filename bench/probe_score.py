"""The indexer's scoring kernel alone, launch choices side by side: bf16 and FP8 index keys, tiles
and warps, and FP8 keys scored in fp16 instead of bf16 (kernels/indexer.py FP8_SCORES_IN_F16).
Each call is captured 4 times in one CUDA graph (bench.kernel_timing.graph_ms); GB/s counts the
keys (and scales) read. Every FP8 choice must give the bf16-widened path's scores (to 1e-5 of the
largest).

    python -m bench.probe_score --batch 16 --contexts 131072 524288 --json score.jsonl
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_indexer import BLOCK, DIM, make_inputs
from bench.kernel_timing import graph_ms
from kernels.indexer import _score_launch

CHOICES = [(64, 2), (64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for context in args.contexts:
        q, w, keys, tables, lens = make_inputs(args.batch, context, "cuda")
        fp8 = keys.to(torch.float8_e4m3fn)
        scale = torch.rand(keys.shape[0], device="cuda") + 0.5
        want = _score_launch(q, w, fp8, tables, lens, BLOCK, key_scale=scale, f16=False)
        for kind in ("bf16", "fp8", "fp8_f16"):
            for tile, warps in CHOICES:
                if kind == "bf16":
                    fn = lambda t=tile, n=warps: _score_launch(q, w, keys, tables, lens, BLOCK, t, n)
                    per_key = 2 * DIM
                else:
                    fn = lambda t=tile, n=warps, f=kind == "fp8_f16": _score_launch(
                        q, w, fp8, tables, lens, BLOCK, t, n, key_scale=scale, f16=f)
                    per_key = DIM + 4
                    got = fn()
                    live = torch.isfinite(want)
                    err = float(((got - want)[live]).abs().max() / want[live].abs().max())
                    if not torch.equal(live, torch.isfinite(got)) or err > 1e-5:
                        raise SystemExit(f"{kind} tile {tile} warps {warps}: scores differ ({err:.2e})")
                us = graph_ms(fn, 3, args.iters, repeat=4) * 1e3
                gbs = args.batch * context * per_key / us / 1e3
                rows.append(dict(batch=args.batch, context=context, keys=kind, tile=tile, warps=warps,
                                 us=round(us, 1), gb_s=round(gbs)))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
