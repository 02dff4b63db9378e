"""The indexer's top-k selection, side by side: the multi-launch radix passes, and the one-launch
select with rows split over programs that meet at barriers (the built-in split, the same with
every byte pass counted by histograms and with the last two counted by atomics where few keys
match, and spans of 256-2048 positions). Each call is captured 16 times in one CUDA
graph (bench.kernel_timing.graph_ms), so launches and the gaps between them count as they do
in the decode step; every choice must pick the reference's positions.

    python -m bench.probe_select --json select.jsonl

`--wide`: rows of 64K-512K positions, all live. The k-th score alone by torch.topk, the radix
passes and the candidates above group maxima (wideep_kernels/wide_select.py), each checked equal to
torch.topk's, then the whole selection (select_topk_triton) with each, checked against the
reference's positions. `--dist` picks the scores: normal, trend (rising towards later
positions) or tied (all but 16 a row equal: every row overflows the candidates, the worst case).

    python -m bench.probe_select --wide --json wide.jsonl

`--prompt`: the rows of one prompt chunk instead (`--batches` rows ending at each width, row i
seeing width - rows + 1 + i positions), with the threshold select and torch.topk beside them.

    python -m bench.probe_select --prompt --batches 1024 --widths 8192 16384 32768
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.kernel_timing import graph_ms
from wideep_kernels.indexer import kth_scores, select_topk_reference, select_topk_triton
from wideep_kernels.row_select import MAX_PARTS, WORKSPACE_COLS, select_rows

TOPK = 2048
BATCHES = (1, 16, 64)
WIDTHS = (8192, 10240, 16384, 32768)
SPLIT = ((256, 256), (512, 256), (512, 512), (1024, 512), (2048, 512))
WIDE_WIDTHS = (65536, 131072, 524288)
_P = dict(block=512, num_warps=4, sparse_max=64)
PROMPT_SPLIT = ([dict(_P, parts=p, sparse_from=f) for p in (1, 2, 4, 8, 16) for f in (1, 2)]
                + [dict(_P, parts=32, sparse_from=2)]
                + [dict(_P, parts=p, sparse_from=1, sparse_max=256) for p in (4, 8)]
                + [dict(_P, parts=p, sparse_from=2, **o) for p in (4, 8)
                   for o in (dict(block=1024), dict(num_warps=8), dict(sparse_max=256))])
WIDE_METHODS = ("topk", "radix", "threshold")
# --prompt: the threshold select with some of its module constants changed (module, {name: value})
THRESHOLD_VARIANTS = {
    "threshold_dense": ("wideep_kernels.wide_select", dict(PASS_SPARSE_FROM=4)),
    "threshold_cb2048": ("wideep_kernels.wide_select", dict(CANDIDATE_BLOCK=2048)),
    "threshold_g2": ("wideep_kernels.wide_select", dict(GROUPS_PER_K=2)),
    "threshold_g3": ("wideep_kernels.wide_select", dict(GROUPS_PER_K=3)),
}


def patched(fn, module: str, attrs: dict):
    """fn, called with the module's constants set to attrs (and set back after)."""
    import importlib
    mod = importlib.import_module(module)

    def call():
        old = {a: getattr(mod, a) for a in attrs}
        for a, v in attrs.items():
            setattr(mod, a, v)
        try:
            return fn()
        finally:
            for a, v in old.items():
                setattr(mod, a, v)
    return call


def wide_scores(batch: int, width: int, dist: str, g: torch.Generator) -> torch.Tensor:
    scores = torch.randn(batch, width, device="cuda", generator=g)
    if dist == "trend":
        scores = scores * 0.3 + torch.linspace(0, 4, width, device="cuda")
    elif dist == "tied":
        scores.zero_()
        scores[:, torch.randperm(width, device="cuda", generator=g)[:16]] = 1.0
    return scores


def wide_rows(widths, batches, dist: str, iters: int) -> list[dict]:
    from wideep_kernels.wide_select import CAPACITY, threshold_passes
    rows = []
    for width in widths:
        for batch in batches:
            g = torch.Generator(device="cuda").manual_seed(batch * width)
            scores = wide_scores(batch, width, dist, g)
            g_lens = torch.full((batch,), width, dtype=torch.int32, device="cuda")
            count = threshold_passes(scores, TOPK, g_lens)[2]
            info = dict(batch=batch, width=width, dist=dist, candidates_max=int(count.max()),
                        overflowed=int((count > CAPACITY).sum()))
            kth_want = kth_scores(scores, TOPK, "topk")
            want = select_topk_reference(scores, g_lens, TOPK).sort(dim=1).values
            choices = {}
            for m in WIDE_METHODS:
                choices[f"kth_{m}"] = (lambda m=m: kth_scores(scores, TOPK, m), kth_want)
            for m in WIDE_METHODS:
                choices[f"select_{m}"] = (lambda m=m: select_topk_triton(scores, g_lens, TOPK, method=m), want)
            for name, (fn, expect) in choices.items():
                got = fn()
                if name.startswith("select_"):
                    got = got.sort(dim=1).values
                if not torch.equal(got, expect):
                    raise SystemExit(f"wrong result: {name} batch {batch} width {width} {dist}")
                us = graph_ms(fn, 3, iters, repeat=16) * 1e3
                rows.append(dict(info, choice=name, us=round(us, 2)))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--wide", action="store_true", help="instead: rows of 64K-512K positions (see above)")
    ap.add_argument("--prompt", action="store_true", help="rows of one prompt chunk (see above)")
    ap.add_argument("--dist", choices=("normal", "trend", "tied"), default="normal", help="--wide scores")
    ap.add_argument("--candidate-programs", type=int, default=None,
                    help="--wide: programs of the candidates' launch (wideep_kernels/wide_select.py CANDIDATE_PROGRAMS)")
    ap.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                    help="time only the choices whose names start so ('phase': the phases of --prompt)")
    args = ap.parse_args(argv)
    if args.candidate_programs:
        import wideep_kernels.wide_select
        wideep_kernels.wide_select.CANDIDATE_PROGRAMS = args.candidate_programs
    if args.wide and args.widths == list(WIDTHS):
        args.widths = list(WIDE_WIDTHS)
    rows = wide_rows(args.widths, args.batches, args.dist, args.iters) if args.wide else []
    for width in [] if args.wide else args.widths:
        for batch in args.batches:
            g = torch.Generator(device="cuda").manual_seed(batch * width)
            scores = torch.randn(batch, width, device="cuda", generator=g)
            if args.prompt:  # a chunk's rows, each seeing one position more than the row before
                g_lens = (torch.arange(batch, device="cuda") + width - batch + 1).clamp(min=1).int()
            else:  # about 8K live positions a row, as a context of 8K in a wider graph bucket
                g_lens = torch.full((batch,), min(width, 8193), dtype=torch.int32, device="cuda")
            scores.masked_fill_(torch.arange(width, device="cuda") >= g_lens[:, None], float("-inf"))
            want = select_topk_reference(scores, g_lens, TOPK).sort(dim=1).values
            out = torch.empty(batch, TOPK, dtype=torch.int32, device="cuda")
            k = min(TOPK, width)
            choices = {"radix": lambda: select_topk_triton(scores, g_lens, TOPK, method="radix"),
                       "split": lambda: select_rows(scores, g_lens, out, k),
                       "split_dense": lambda: select_rows(scores, g_lens, out, k, sparse_from=4),
                       "split_sparse": lambda: select_rows(scores, g_lens, out, k, sparse_from=2),
                       "split_no_record": lambda: select_rows(scores, g_lens, out, k, record=False)}
            if args.prompt:
                old_parts = min(MAX_PARTS, -(-2048 // batch))  # before the L2 rule (row_select.split_row)
                choices["old_default"] = lambda: select_rows(
                    scores, g_lens, out, k, span=512 * -(-width // (old_parts * 512)),
                    sparse_from=2 if batch <= 64 else 4, record=False)
                threshold = lambda: select_topk_triton(scores, g_lens, TOPK, method="threshold")  # noqa: E731
                choices["threshold"] = threshold
                for name, (module, attrs) in THRESHOLD_VARIANTS.items():
                    choices[name] = patched(threshold, module, attrs)
                choices["topk"] = lambda: select_topk_triton(scores, g_lens, TOPK, method="topk")
                # a prompt chunk's rows are many: a row in 1-32 parts, and the atomics' options
                for c in PROMPT_SPLIT:
                    span = c["block"] * -(-width // (c["parts"] * c["block"]))
                    name = "p{parts}_f{sparse_from}_b{block}_w{num_warps}_m{sparse_max}".format(**c)
                    choices[name] = (lambda s=span, c=c: select_rows(
                        scores, g_lens, out, k, span=s, block=c["block"], sparse_from=c["sparse_from"],
                        num_warps=c["num_warps"], sparse_max=c["sparse_max"]))
            for span, block in [] if args.prompt else SPLIT:
                if span < width and -(-width // span) <= MAX_PARTS:
                    choices[f"split_s{span}_b{block}"] = (
                        lambda s=span, b=block: select_rows(scores, g_lens, out, k, span=s, block=b))
            if args.prompt and (not args.only or "phase" in args.only):  # the built-in split's phases, each its own launch over the real workspace
                ws = torch.zeros(batch, WORKSPACE_COLS, dtype=torch.int32, device="cuda")
                select_rows(scores, g_lens, out, k, phased=True, ws=ws)
                done = ws.clone()
                restore = lambda: ws.copy_(done)  # noqa: E731 (the passes add into the histograms)
                base_us = graph_ms(restore, 3, args.iters, repeat=16) * 1e3
                for p in range(6):
                    fn = lambda p=p: (restore(), select_rows(scores, g_lens, out, k, phased=True, ws=ws, only_phase=p))
                    us = graph_ms(fn, 3, args.iters, repeat=16) * 1e3 - base_us
                    rows.append(dict(batch=batch, width=width, choice=f"phase_{p}", us=round(us, 2)))
                    print(json.dumps(rows[-1]), flush=True)
            if args.only:
                choices = {n: f for n, f in choices.items() if n.startswith(tuple(args.only))}
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
    shapes = [(w, b) for w in args.widths for b in args.batches]
    print("\n| choice | " + " | ".join(f"{w} x {b}" for w, b in shapes) + " |")
    for choice in dict.fromkeys(r["choice"] for r in rows):
        us = {(r["width"], r["batch"]): r["us"] for r in rows if r["choice"] == choice}
        print(f"| {choice} | " + " | ".join(f"{us[s]:.1f}" if s in us else "" for s in shapes) + " |")


if __name__ == "__main__":
    main()
