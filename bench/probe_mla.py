"""Where the MLA decode kernel's time goes at the engine's top-k shapes (16 heads, 2048 top-k
entries of an 8K context, a 128-entry window ring): launch configurations and the slot
pre-resolution side by side, a gather-only kernel reading the same rows (the memory floor of
that access pattern), the merge kernel alone, and each build's registers, spills and shared
memory. GPU only. `python -m bench.probe_mla --json out.jsonl`
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from bench.kernel_mla_decode import make_inputs
from wideep_kernels import _unusable, mla_decode as mla

HEADS, KV_LORA, ROPE, BLOCK, TOPK, WINDOW = 16, 512, 64, 64, 2048, 128


def reps_ms(fn, reps: int = 20, iters: int = 20) -> float:
    """Time of one call: `reps` calls captured in one CUDA graph, replayed, divided."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


@triton.jit
def _gather_only_kernel(topk_ptr, table_ptr, stride_tb, kv_ptr, stride_kv, out_ptr, num_topk, keys_per_split,
                        block_size, RESOLVED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    split = tl.program_id(0)
    b = tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    start0 = split * keys_per_split
    end = tl.minimum(start0 + keys_per_split, num_topk)
    for start in range(start0, end, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        valid = idx < end
        if RESOLVED:
            slot = tl.load(topk_ptr + b * num_topk + idx, mask=valid, other=0).to(tl.int64)
        else:
            pos = tl.load(topk_ptr + b * num_topk + idx, mask=valid, other=0)
            block = tl.load(table_ptr + b * stride_tb + pos // block_size, mask=valid, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
        rows = tl.load(kv_ptr + slot[:, None] * stride_kv + cols[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(rows.to(tl.float32), 0)
    tl.store(out_ptr + (b * tl.num_programs(0) + split) * BLOCK_C + cols, acc)


def build_stats() -> list[dict]:
    out = []
    for fn in (mla._split_kernel, mla._rows_split_kernel, mla._merge_kernel):
        caches = getattr(fn, "device_caches", {})
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kernel in cache.values():
                try:
                    ptx = kernel.asm.get("ptx", "")
                    out.append(dict(kernel=fn.__name__, regs=kernel.n_regs, spills=kernel.n_spills,
                                    shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
                                    stages=kernel.metadata.num_stages, wgmma="wgmma" in ptx,
                                    mma_sync="mma.sync" in ptx, cp_async="cp.async" in ptx))
                except Exception as exc:  # metadata names differ across Triton versions
                    out.append(dict(kernel=fn.__name__, error=repr(exc)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sections", nargs="+", default=["configs", "gather", "merge"],
                    choices=["configs", "gather", "merge"], help="what to time (default: all)")
    ap.add_argument("--configs", type=json.loads, default=None,
                    help='with the configs section: time only these launch configurations (a JSON list)')
    ap.add_argument("--once", action="store_true", help="only run the engine's configuration a few times (for ncu)")
    ap.add_argument("--config", type=json.loads, default=None,
                    help='with --once: this launch configuration instead, e.g. \'{"keys_rows": true, ...}\'')
    args = ap.parse_args()
    dev = "cuda"
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for b in args.batches:
        q, kv, tables, lens, topk_pos = make_inputs(b, 8192, dev, HEADS, KV_LORA, ROPE, BLOCK, TOPK)
        d = KV_LORA + ROPE
        ring_kv = torch.randn(b, WINDOW, d, device=dev, dtype=torch.bfloat16)
        ring = (ring_kv, torch.arange(b, device=dev), torch.randn(b, d, device=dev, dtype=torch.bfloat16),
                torch.zeros(b, dtype=torch.long, device=dev))
        valid = torch.ones(b, WINDOW + 1, dtype=torch.bool, device=dev)
        valid[:, 0] = False  # the entry the step overwrites
        gb = b * (TOPK + WINDOW + 1) * d * 2 / 1e9

        def call(cfg):
            return mla.mla_decode_triton(q, kv, None, tables, lens, BLOCK, 192 ** -0.5, KV_LORA, topk_pos=topk_pos,
                                         win_valid=valid, ring=ring, config=cfg)
        ref = call(None).float()
        if args.once:
            for _ in range(4):
                call(args.config)
            torch.cuda.synchronize()
            continue
        ms = reps_ms(lambda: call(None))
        emit(dict(probe="tuned", batch=b, ms=round(ms, 4), tbs=round(gb / ms, 3)))
        # heads as rows (wideep_kernels/mla_decode.py) with and without slots, and keys as rows
        # (wideep_kernels/mla_decode_rows.py), whose Hopper MMAs want 64-key tiles or more
        space = [dict(block_n=n, num_warps=w, num_stages=st, waves=wv, slots=sl, keys_rows=kr)
                 for kr, n, w, st, wv, sl in itertools.product((False, True), (16, 32, 64), (4, 8), (2, 3),
                                                               (1, 2), (False, True))
                 if (n == 64 and st == 2 and sl if kr else True)]
        # the Gluon form of keys as rows (wideep_kernels/mla_decode_gluon.py): 64-key tiles, slots
        space += [dict(block_n=64, num_warps=w, num_stages=2, waves=wv, slots=True, keys_rows=True, gluon=True)
                  for w, wv in itertools.product((4, 8), (1, 2))]
        if args.configs is not None:
            space = args.configs
        for cfg in space if "configs" in args.sections else ():
            cfg = dict(dict(min_tiles=1), **cfg)
            try:
                err = (call(cfg).float() - ref).abs().max().item()
                ms = reps_ms(lambda: call(cfg))
            except Exception as exc:
                emit(dict(probe="config", batch=b, **cfg, error=type(exc).__name__))
                continue
            # a Gluon build that failed falls back to the Triton kernel for the rest of the process
            emit(dict(probe="config", batch=b, **cfg, ms=round(ms, 4), tbs=round(gb / ms, 3), err=round(err, 4),
                      gluon_failed="mla_decode_gluon" in _unusable))

        # the same rows read with nothing else done: the access pattern's own floor
        resolved = (tables.long().gather(1, topk_pos.long() // BLOCK) * BLOCK + topk_pos.long() % BLOCK).to(torch.int32)
        gbr = b * TOPK * KV_LORA * 2 / 1e9
        for resolved_in, bn, warps, splits in itertools.product((False, True), (32, 64), (4,), (8, 16)) \
                if "gather" in args.sections else ():
            kps = triton.cdiv(TOPK, splits)
            out = torch.empty(b * splits * 512, device=dev)
            src = resolved if resolved_in else topk_pos

            def gather():
                _gather_only_kernel[(splits, b)](src, tables, tables.stride(0), kv, kv.stride(0), out, TOPK, kps, BLOCK,
                                                 RESOLVED=resolved_in, BLOCK_N=bn, BLOCK_C=512, num_warps=warps)
            ms = reps_ms(gather)
            emit(dict(probe="gather", batch=b, resolved=resolved_in, block_n=bn, num_warps=warps, splits=splits,
                      ms=round(ms, 4), tbs=round(gbr / ms, 3)))

        for splits, bcc, bsc, warps in itertools.product((4, 8, 35), (128, 256, 512), (4, 8, 16, 32), (4, 8)) \
                if "merge" in args.sections else ():
            acc = torch.randn(b, splits, HEADS, KV_LORA, device=dev)
            m = torch.randn(b, splits, HEADS, device=dev)
            l = torch.rand(b, splits, HEADS, device=dev)
            out = torch.empty(b, HEADS, KV_LORA, device=dev, dtype=torch.bfloat16)

            def merge():
                mla._merge_kernel[(triton.cdiv(KV_LORA, bcc), HEADS, b)](
                    acc, m, l, out, out.stride(0), out.stride(1), splits, HEADS, KV_LORA,
                    BLOCK_SC=bsc, BLOCK_CC=bcc, num_warps=warps)
            emit(dict(probe="merge", batch=b, splits=splits, block_cc=bcc, block_sc=bsc, num_warps=warps,
                      ms=round(reps_ms(merge), 4)))
    for stat in build_stats():
        emit(dict(probe="build", **stat))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
