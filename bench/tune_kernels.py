"""Measure every candidate launch configuration of the MLA decode and indexer scoring kernels on
this GPU and write the fastest per shape to wideep_kernels/tuned/<gpu name>.json (wideep_kernels/tuning.py).

    python -m bench.tune_kernels                      # on the GPU to tune; prints a table
    python -m bench.tune_kernels --quick --dry-run    # fewer shapes, nothing written

Shapes are the `bench` model's: 16 query heads over 512 + 64 latents (top-2048 and dense rows,
a 129-entry window read from the ring as decode reads it), 8 x 64 indexer heads. Each
candidate runs in a CUDA graph (so small batches time the GPU, not the host launching) and
must agree with the built-in configuration's output; one that fails to build or disagrees is
skipped. Every entry keeps its time and the built-in configuration's, so the file shows what
tuning bought.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from bench.kernel_mla_decode import make_inputs as mla_inputs
from bench.kernel_mla_decode import quantize_in_chunks
from bench.kernel_timing import graph_ms
from wideep_kernels import tuning
from wideep_kernels.fp8_kv import quantize_kv
from wideep_kernels.index_score import _score_launch, score_tune_key
from wideep_kernels.mla_decode import mla_decode_triton, tune_key

HEADS, KV_LORA, ROPE, BLOCK, TOPK, WINDOW = 16, 512, 64, 64, 2048, 129
MLA_SPACE = dict(block_n=(32, 64), num_warps=(4, 8), num_stages=(2, 3), waves=(1, 2, 4), min_tiles=(1, 2, 4))
# Keys as rows (wideep_kernels/mla_decode_rows.py): 64-key tiles (Hopper MMAs want 64 rows; two stages
# of them fill shared memory), bf16 KV only (its FP8 builds spill about 0.9 KB a thread).
MLA_ROWS_SPACE = dict(block_n=(64,), num_warps=(4, 8), num_stages=(2,), waves=(1, 2), min_tiles=(1, 4),
                      keys_rows=(True,))
# The Gluon form of keys as rows (wideep_kernels/mla_decode_gluon.py), bf16 or FP8 KV; top-k positions
# resolved by their own launch first (slots) or inside the kernel.
MLA_GLUON_SPACE = dict(MLA_ROWS_SPACE, gluon=(True,), slots=(True, False))
SCORE_SPACE = dict(tile=(64, 128, 256, 512), num_warps=(2, 4, 8))


def candidates(space: dict) -> list[dict]:
    return [dict(zip(space, values)) for values in itertools.product(*space.values())]


def best_of(run, space: dict | list[dict], reference: torch.Tensor, tol: float,
            fastest: list | None = None) -> tuple[dict | None, float, float]:
    """(fastest agreeing config, its us, the built-in config's us); space: a dict of choices, or a
    list of them, in which case `fastest` (when given) gets each one's best us, side by side."""
    base_us = graph_ms(lambda: run(None), 3, 20) * 1e3
    best, best_us = None, float("inf")
    spaces = space if isinstance(space, list) else [space]
    for i, sp in enumerate(spaces):
        sub_best, sub_us = _fastest(run, sp, reference, tol)
        if fastest is not None:
            fastest.append(round(sub_us, 2) if sub_best is not None else None)
        if sub_us < best_us:
            best, best_us = sub_best, sub_us
    return best, best_us, base_us


def _fastest(run, space: dict, reference: torch.Tensor, tol: float) -> tuple[dict | None, float]:
    best, best_us = None, float("inf")
    for cfg in candidates(space):
        try:
            out = run(cfg)
            torch.cuda.synchronize()
        except Exception:  # does not build or launch on this GPU (registers, shared memory)
            continue
        if (out.float() - reference.float()).abs().max().item() > tol:
            continue
        us = graph_ms(lambda: run(cfg), 3, 20) * 1e3
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us


def record(kernel: str, key: str, best: dict | None, us: float, base: float, entries: dict, rows: list,
           **extra) -> None:
    """Keep a config that beat the built-in one; print and keep the row (with `extra`) either way."""
    if best is not None and us < base:
        entries[key] = dict(best, us=round(us, 2), builtin_us=round(base, 2))
    tuned = round(us, 2) if best is not None else None
    rows.append(dict(kernel=kernel, key=key, builtin_us=round(base, 2), tuned_us=tuned,
                     speedup=round(base / us, 2) if tuned else None, config=best, **extra))
    print(json.dumps(rows[-1]), flush=True)


def wanted(key: str, shapes) -> bool:
    return shapes is None or any(part in key for part in shapes)


def tune_mla(batches, device, shapes=None, save=None) -> tuple[dict, list[dict]]:
    """save(entries), when given, after each shape: a run cut short keeps what it measured."""
    entries, rows = {}, []
    for fp8, topk, b in itertools.product((False, True), (True, False), batches):
        if not wanted(tune_key(b, HEADS, KV_LORA + ROPE, fp8, topk), shapes):
            continue
        context = 8192 if topk else TOPK
        q, kv, tables, lens, topk_pos = mla_inputs(b, context, device, HEADS, KV_LORA, ROPE, BLOCK,
                                                   TOPK if topk else None)
        scale = None
        if fp8:
            kv, scale = quantize_in_chunks(kv)
        # the window as decode reads it: ring rows plus the fresh latent, the entry it overwrites masked
        d = KV_LORA + ROPE
        ring = (torch.randn(b, WINDOW - 1, d, device=device, dtype=torch.bfloat16), torch.arange(b, device=device),
                torch.randn(b, d, device=device, dtype=torch.bfloat16), torch.zeros(b, dtype=torch.long, device=device))
        win_valid = torch.ones(b, WINDOW, dtype=torch.bool, device=device)
        win_valid[:, 0] = False

        def run(cfg):
            return mla_decode_triton(q, kv, scale, tables, lens, BLOCK, 192 ** -0.5, KV_LORA, topk_pos=topk_pos,
                                     win_valid=win_valid, ring=ring, config=cfg)
        ref = run(None)
        spaces = dict(heads_rows_us=MLA_SPACE, keys_rows_us=None if fp8 else MLA_ROWS_SPACE, gluon_us=MLA_GLUON_SPACE)
        spaces = {name: space for name, space in spaces.items() if space is not None}
        fastest = []
        best, us, base = best_of(run, list(spaces.values()), ref, tol=3e-2 * ref.float().abs().max().item(),
                                 fastest=fastest)
        key = tune_key(b, HEADS, KV_LORA + ROPE, fp8, topk)
        # the best of each kernel form, side by side
        record("mla_decode", key, best, us, base, entries, rows, **dict(zip(spaces, fastest)))
        if save is not None:
            save(entries)
    return entries, rows


def tune_score(device, shapes=None) -> tuple[dict, list[dict]]:
    """One configuration per key type for every row width (a width-dependent choice would build
    a new kernel variant mid-serving when a context crosses the threshold): each candidate is
    timed on a short and a long shape in one graph, their sum ranked."""
    entries, rows = {}, []
    heads, dim = 8, 64
    for fp8 in (False, True):
        if not wanted(score_tune_key(heads, dim, fp8), shapes):
            continue
        inputs = []
        for batch, context in ((64, 8192), (16, 131072)):
            g = torch.Generator(device=device).manual_seed(0)
            blocks = -(-context // BLOCK)
            tables = torch.randperm(batch * blocks, generator=g, device=device).view(batch, blocks).to(torch.int32)
            q = torch.randn(batch, heads, dim, generator=g, device=device, dtype=torch.bfloat16)
            w = torch.randn(batch, heads, generator=g, device=device, dtype=torch.bfloat16)
            keys = torch.randn(batch * blocks * BLOCK, dim, generator=g, device=device, dtype=torch.bfloat16)
            scale = None
            if fp8:
                keys, scale = quantize_kv(keys)
            lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            inputs.append((q, w, keys, tables, lens, scale))

        def run(cfg):
            cfg = cfg or {}
            return torch.cat([_score_launch(q, w, keys, tables, lens, BLOCK, tile=cfg.get("tile"),
                                            num_warps=cfg.get("num_warps"), key_scale=scale).flatten()
                              for q, w, keys, tables, lens, scale in inputs])
        ref = run(None)
        best, us, base = best_of(run, SCORE_SPACE, ref, tol=1e-3 * ref.abs().max().item())
        record("indexer_score", score_tune_key(heads, dim, fp8), best, us, base, entries, rows)
    return entries, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64 only")
    ap.add_argument("--dry-run", action="store_true", help="print, do not write the table")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="tune only shape keys containing one of these (e.g. 'bf16|topk'); the table's other "
                         "entries are kept")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    path = tuning.TUNED_DIR / f"{tuning.gpu_key(device)}.json"
    # Tune against the built-in choices: an existing table (or a same-capability one) must not steer
    # the baseline.
    tuning.TUNED_DIR = tuning.TUNED_DIR / "_none"
    os.environ.pop("WIDEEP_TUNED_TABLE", None)
    tuning.reload()
    batches = (1, 64) if args.quick else tuning.BATCH_BUCKETS
    table = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
             "capability": tuning.capability_key(device)}
    old = json.loads(path.read_text()) if args.shapes and path.exists() else {}
    rows = []

    def save(name: str, entries: dict) -> None:
        # with --shapes: the untuned shapes keep their entries, a tuned one loses its old entry
        kept = {k: v for k, v in old.get(name, {}).items() if not wanted(k, args.shapes)}
        table[name] = dict(kept, **entries)
        if not args.dry_run:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    for name, tune in (("mla_decode", lambda: tune_mla(batches, device, args.shapes, lambda e: save(name, e))),
                       ("indexer_score", lambda: tune_score(device, args.shapes))):
        entries, kernel_rows = tune()
        save(name, entries)
        rows += kernel_rows
        if not args.dry_run:
            print(f"wrote {path}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| kernel | shape | built-in us | tuned us | speedup |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kernel']} | {r['key']} | {r['builtin_us']} | {r['tuned_us']} | {r['speedup']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
