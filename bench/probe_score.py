"""The indexer's scoring kernel alone, launch choices side by side: bf16 and FP8 index keys, tiles,
warps, tiles a program (`--loops`: each program scores that many tiles, the query loaded once),
pipeline stages, the threshold select's group maxima written by the same launch (`--maxima`,
wideep_kernels/index_score.py _score_launch), and FP8 keys scored in fp16 instead of bf16
(FP8_SCORES_IN_F16). Each call is captured 4 times in one CUDA graph
(bench.kernel_timing.graph_ms); GB/s counts the keys (and scales) read. Every choice must give
the one-tile-a-program bf16-widened scores (to 1e-5 of the largest; bf16 keys: exactly).

    python -m bench.probe_score --batch 16 --contexts 131072 524288 --json score.jsonl
    python -m bench.probe_score --kinds bf16 fp8_f16 --choices 128:2 128:4 --loops 1 4 16 --maxima
    python -m bench.probe_score --batch 1 --kinds fp8_f16 --cold --loops 1 2 4 8

`--cold` times keys read from HBM (a copy of the pool for each call), as in the decode step,
whose layers read the keys of their own KV source with a layer's weights streamed in between.
Without it a batch-1 pool of a few tens of MB stays in the L2 (50 MB on an H200) between calls:
at 512K, 13.6 us a call warm against 15.8 cold (RESULTS, eighteenth session).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.kernel_indexer import BLOCK, DIM, make_inputs
from bench.kernel_timing import graph_ms
from wideep_kernels.index_score import _score_launch
from wideep_kernels.wide_select import group_stride

CHOICES = ["64:2", "64:4", "128:2", "128:4", "128:8", "256:4", "256:8"]
TOPK = 2048


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--kinds", nargs="+", default=["bf16", "fp8", "fp8_f16"], choices=["bf16", "fp8", "fp8_f16"])
    ap.add_argument("--choices", nargs="+", default=CHOICES, help="tile:warps pairs")
    ap.add_argument("--loops", type=int, nargs="+", default=[1], help="tiles a program")
    ap.add_argument("--stages", type=int, nargs="+", default=[1], help="num_stages of the tile loop")
    ap.add_argument("--maxima", action="store_true",
                    help=f"also time the launches that write the group maxima (top-{TOPK} group stride)")
    ap.add_argument("--cold", action="store_true",
                    help="keys from HBM, as in a decode step whose layers each read their own: every call of "
                         "the graph scores its own copy of the key pool, copies filling 4x the L2")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for context in args.contexts:
        q, w, keys, tables, lens = make_inputs(args.batch, context, "cuda")
        fp8 = keys.to(torch.float8_e4m3fn)
        scale = torch.rand(keys.shape[0], device="cuda") + 0.5
        want = {"bf16": _score_launch(q, w, keys, tables, lens, BLOCK, 128, 4)}
        want["fp8"] = want["fp8_f16"] = _score_launch(q, w, fp8, tables, lens, BLOCK, key_scale=scale, f16=False)
        width = -(-context // BLOCK) * BLOCK
        loops = [(n, None) for n in args.loops] + ([("maxima", None)] if args.maxima else [])
        copies = 1
        if args.cold:  # (the same block tables: only the pool differs)
            l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
            copies = max(2, -(-4 * l2 // (fp8.numel() + 4 * scale.numel())))
        pools = [(keys, fp8, scale)] + [(keys.clone(), fp8.clone(), scale.clone()) for _ in range(copies - 1)]
        for kind, choice, (loop, _), stages in itertools.product(args.kinds, args.choices, loops, args.stages):
            tile, warps = map(int, choice.split(":"))
            m = None
            programs = None
            if loop == "maxima":
                m = torch.empty(args.batch, -(-group_stride(context, TOPK) // tile) * tile, device="cuda")
            else:
                programs = max(1, -(-width // tile) // loop)
            opts = dict(tile=tile, num_warps=warps, num_stages=stages, maxima=m, programs=programs)
            if kind == "bf16":
                fns = [lambda o=opts, k=k: _score_launch(q, w, k, tables, lens, BLOCK, **o) for k, _, _ in pools]
                per_key = 2 * DIM
            else:
                fns = [lambda o=opts, f=kind == "fp8_f16", k=k, s=s: _score_launch(
                    q, w, k, tables, lens, BLOCK, key_scale=s, f16=f, **o) for _, k, s in pools]
                per_key = DIM + 4
            fn = fns[0]
            got, ref = fn(), want[kind]
            live = torch.isfinite(ref)
            err = float(((got - ref)[live]).abs().max() / ref[live].abs().max())
            if not torch.equal(live, torch.isfinite(got)) or err > (0 if kind == "bf16" else 1e-5):
                raise SystemExit(f"{kind} {choice} loop {loop} stages {stages}: scores differ ({err:.2e})")
            if m is not None:
                padded = torch.full((args.batch, -(-context // m.shape[1]) * m.shape[1]), float("-inf"), device="cuda")
                padded[:, :context] = got
                if not torch.equal(m, padded.view(args.batch, -1, m.shape[1]).amax(dim=1)):
                    raise SystemExit(f"{kind} {choice} stages {stages}: group maxima differ")
            if copies > 1:
                us = graph_ms(lambda: [f() for f in fns], 3, args.iters) * 1e3 / copies
            else:
                us = graph_ms(fn, 3, args.iters, repeat=4) * 1e3
            gbs = args.batch * context * per_key / us / 1e3
            rows.append(dict(batch=args.batch, context=context, keys=kind, tile=tile, warps=warps, loop=loop,
                             stages=stages, cold=copies > 1, us=round(us, 1), gb_s=round(gbs)))
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
