"""The indexer's scoring of a prompt chunk's rows: row by row against several rows a program
(wideep_kernels/index_score_rows.py), with the selection's flags the engine passes, and the
selection after it (`indexer_topk_triton`, the whole of the indexer's work for a chunk).

    python -m bench.probe_score_rows --contexts 8192 32768 100000 --rows 1024
    python -m bench.probe_score_rows --choices 64:4 64:8 128:8 64:4:3 --rows-per-program 8 16

A case is one sequence of `context` positions whose last `--rows` rows are the chunk (row r sees
context - rows + r + 1 positions), and a mixed step: 64 decoding sequences of the same context
followed by the chunk (`--mixed`). Each call is captured in a CUDA graph (bench.kernel_timing.graph_ms).
Every choice must give the reference's top-k sets; the scores must match the row-by-row ones to
1e-5 of the largest.
"""
from __future__ import annotations

import argparse
import json

import torch

import wideep_kernels.index_score as score
import wideep_kernels.index_score_rows as score_rows
import wideep_kernels.indexer as indexer
from bench.kernel_timing import graph_ms
from wideep_kernels.index_score_rows import prompt_row_groups
from wideep_kernels.indexer import indexer_topk_triton

BLOCK = 64
HEADS, DIM, TOPK = 8, 64, 2048  # the bench model's indexer


def make_chunk(context: int, rows: int, decoding: int, fp8: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs = decoding + 1
    blocks = -(-context // BLOCK)
    tables = torch.randperm(seqs * blocks, generator=g).view(seqs, blocks).to(torch.int32)
    row_seqs = torch.cat([torch.arange(decoding), torch.full((rows,), decoding)])
    lens = torch.cat([torch.full((decoding,), context), torch.arange(context - rows + 1, context + 1)])
    total = decoding + rows
    q = torch.randn(total, HEADS, DIM, generator=g).bfloat16()
    w = torch.randn(total, HEADS, generator=g).bfloat16()
    keys = torch.randn(seqs * blocks * BLOCK, DIM, generator=g).bfloat16()
    scale = None
    if fp8:
        keys, scale = keys.to(torch.float8_e4m3fn), (torch.rand(keys.shape[0], generator=g) + 0.5)
    dev = [t.cuda() if t is not None else None for t in (q, w, keys, tables[row_seqs], lens.to(torch.int32),
                                                         row_seqs, scale)]
    return dev


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100000])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--mixed", action="store_true", help="also a step of 64 decoding rows beside the chunk")
    ap.add_argument("--kinds", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--choices", nargs="+", default=[f"{score.ROWS_TILE}:{score.ROWS_WARPS}"],
                    help="tile:warps or tile:warps:stages (the live tiles' software-pipeline stages)")
    ap.add_argument("--rows-per-program", type=int, nargs="+", default=[0], help="0: rows_per_group's choice")
    ap.add_argument("--no-fused", action="store_true",
                    help="also time the indexer with the wide rows' selection where the one-launch select serves")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = []
    default_stages = score_rows.ROWS_STAGES
    cases = [(c, k, d) for c in args.contexts for k in args.kinds for d in ([0, 64] if args.mixed else [0])]
    for context, kind, decoding in cases:
        q, w, keys, tables, lens, row_seqs, scale = make_chunk(context, args.rows, decoding, kind == "fp8")
        common = dict(key_scale=scale, w_scale=HEADS ** -0.5)

        def scores(groups):
            return score._score_launch(q, w, keys, tables, lens, BLOCK, skip_dead=True, **common, row_groups=groups)

        def topk(groups):
            return indexer_topk_triton(q, w, keys, tables, lens, BLOCK, TOPK, **common, row_groups=groups)

        base = dict(context=context, kind=kind, rows=args.rows, decoding=decoding)
        want = scores(None)
        want_sets = topk(None).sort(dim=1).values
        row = dict(base, choice="row by row", score_ms=graph_ms(lambda: scores(None), 3, args.iters),
                   indexer_ms=graph_ms(lambda: topk(None), 3, args.iters))
        print(json.dumps(row), flush=True)
        out.append(row)
        for choice in args.choices:
            tile, warps, *stages = map(int, choice.split(":"))
            score.ROWS_TILE, score.ROWS_WARPS = tile, warps
            score_rows.ROWS_STAGES = stages[0] if stages else default_stages
            for per in args.rows_per_program:
                groups = prompt_row_groups(row_seqs, HEADS, decoding + 1, rows=per or None)
                got = scores(groups)
                live = torch.arange(want.shape[1], device="cuda")[None, :] < lens[:, None]
                err = float((got - want).abs()[live].max() / want[live].abs().max())
                same = bool(torch.equal(topk(groups).sort(dim=1).values, want_sets))
                row = dict(base, choice=choice, rows_per_program=groups.rows,
                           score_ms=graph_ms(lambda: scores(groups), 3, args.iters),
                           indexer_ms=graph_ms(lambda: topk(groups), 3, args.iters),
                           rel_err=err, same_topk=same)
                print(json.dumps(row), flush=True)
                out.append(row)
        if args.no_fused and context <= indexer.FUSED_MAX_WIDTH:  # the wide rows' selection instead
            fused, indexer.FUSED_MAX_WIDTH = indexer.FUSED_MAX_WIDTH, 0
            groups = prompt_row_groups(row_seqs, HEADS, decoding + 1)
            same = bool(torch.equal(topk(groups).sort(dim=1).values, want_sets))
            row = dict(base, choice=f"{score.ROWS_TILE}:{score.ROWS_WARPS}, no one-launch select",
                       rows_per_program=groups.rows, score_ms=None,
                       indexer_ms=graph_ms(lambda: topk(groups), 3, args.iters), same_topk=same)
            indexer.FUSED_MAX_WIDTH = fused
            print(json.dumps(row), flush=True)
            out.append(row)
    print("\n| context | keys | decoding rows | choice | rows a program | score ms | indexer ms | same top-k |")
    print("|---|---|---|---|---|---|---|---|")
    ms = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731 (None: the call could not be captured)
    for r in out:
        print(f"| {r['context']} | {r['kind']} | {r['decoding']} | {r['choice']} | {r.get('rows_per_program', 1)} | "
              f"{ms(r['score_ms'])} | {ms(r['indexer_ms'])} | {r.get('same_topk', '-')} |")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in out)


if __name__ == "__main__":
    main()
