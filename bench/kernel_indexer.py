"""Indexer top-k for decode: plain-torch reference vs Triton scoring + packed top-k.

Eager timings (ref_ms, triton_ms) include the host's kernel launches, which dominate small
shapes; the *_graph_ms columns replay the same calls from a CUDA graph (GPU time alone).
Every sequence sees `context` positions of bf16 index keys (Hi=8 heads, Di=64, blocks of 64
slots scattered over one slab); topk=2048. Both paths run on the same inputs in the same
process; the kernel's choice is checked against the reference's on those inputs:
`agree` is the fraction of the reference's positions the kernel also chose, and `worst_gap`
how far (in score) the kernel's weakest pick falls below the reference's k-th score, which
stays ~0 when the only disagreements are near-ties rounded differently. select_<method>_ms
time the selection alone by each method (wideep_kernels/indexer.py select_topk_triton), 16 calls in one CUDA
graph on GPU, so that each call's launches and gaps count as they do in the decode step.

    python -m bench.kernel_indexer --device cuda --json bench/results/kernel_indexer.json
    python -m bench.kernel_indexer --device cpu --quick     # interpreter smoke test
"""
from __future__ import annotations

import os

import torch

from bench.kernel_timing import bench_main, graph_ms, time_ms

HEADS, DIM, BLOCK = 8, 64, 64


def make_inputs(batch: int, context: int, device: str, block_size: int = BLOCK, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    perm = torch.randperm(batch * blocks_per_seq, generator=g)
    tables = perm.view(batch, blocks_per_seq).to(torch.int32).to(device)
    dtype = torch.bfloat16
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=dtype)
    w = torch.randn(batch, HEADS, device=device, dtype=dtype)
    keys = torch.randn(batch * blocks_per_seq * block_size, DIM, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, w, keys, tables, lens


def reference_batch_that_fits(batch: int, context: int, device: str) -> int:
    """Largest batch (halving) whose reference intermediates fit in half the free memory."""
    if not device.startswith("cuda"):
        return batch
    free, _ = torch.cuda.mem_get_info()
    # gathered keys bf16 + fp32, per-head scores, row scores, stable sort values + indices
    per_seq = context * (DIM * 6 + HEADS * 4 + 4 + 4 * 12)
    b = batch
    while b > 1 and b * per_seq > free // 2:
        b //= 2
    return b


def compare(got: torch.Tensor, ref_pos: torch.Tensor, ref_scores: torch.Tensor) -> tuple[float, float]:
    chosen = torch.zeros_like(ref_scores, dtype=torch.bool)
    rows = torch.arange(ref_pos.shape[0], device=ref_pos.device)[:, None].expand_as(ref_pos)
    valid = ref_pos >= 0
    chosen[rows[valid], ref_pos[valid].long()] = True
    got_valid = got >= 0
    if int(got_valid.sum()) != int(valid.sum()):
        return 0.0, float("inf")
    hit = chosen[rows[got_valid], got[got_valid].long()]
    agree = float(hit.float().mean()) if hit.numel() else 1.0
    kth = torch.where(valid, ref_scores.gather(1, ref_pos.clamp(min=0).long()), float("inf")).amin(1)
    picked = torch.where(got_valid, ref_scores.gather(1, got.clamp(min=0).long()), float("inf")).amin(1)
    gap = float((kth - picked).clamp(min=0).max()) if kth.numel() else 0.0
    return agree, gap


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from wideep_kernels.indexer import (
        indexer_scores_reference, indexer_scores_triton, indexer_topk_reference, indexer_topk_triton,
        select_topk_triton)

    if quick:
        topk, cases, iters, warmup = 64, [(256, 1), (256, 4), (1024, 1), (1024, 4)], 3, 1
    else:
        topk, iters, warmup = 2048, 20, 3
        cases = [(c, b) for c in (8192, 131072, 524288) for b in (1, 16, 64) if not (b == 64 and c > 131072)]
    rows = []
    for context, batch in cases:
        q, w, keys, tables, lens = make_inputs(batch, context, device)
        args = (q, w, keys, tables, lens, BLOCK)
        ref_b = reference_batch_that_fits(batch, context, device)
        ref_args = (q[:ref_b], w[:ref_b], keys, tables[:ref_b], lens[:ref_b], BLOCK)

        got = indexer_topk_triton(*args, topk)
        ref_pos = indexer_topk_reference(*ref_args, topk)
        ref_scores = indexer_scores_reference(*ref_args)
        agree, gap = compare(got[:ref_b], ref_pos, ref_scores)
        live = torch.isfinite(ref_scores)
        tri_scores = indexer_scores_triton(*ref_args)
        score_err = float((tri_scores[live] - ref_scores[live]).abs().max())
        score_mag = float(ref_scores[live].abs().max())
        del ref_pos, ref_scores, tri_scores, live

        ref_ms = time_ms(lambda: indexer_topk_reference(*ref_args, topk), device, warmup, iters)
        tri_ms = time_ms(lambda: indexer_topk_triton(*args, topk), device, warmup, iters)
        score_ms = time_ms(lambda: indexer_scores_triton(*args), device, warmup, iters)
        scores = indexer_scores_triton(*args)
        select_ms = time_ms(lambda: select_topk_triton(scores, lens, topk), device, warmup, iters)
        cuda = device.startswith("cuda")
        # Each selection method side by side, as the decode step runs it (in a CUDA graph on GPU).
        by_method = {}
        for method in ("fused", "radix", "topk"):
            fn = lambda m=method: select_topk_triton(scores, lens, topk, method=m)  # noqa: E731
            by_method[f"select_{method}_ms"] = round(graph_ms(fn, 3, iters, repeat=16) if cuda else time_ms(fn, device, warmup, iters), 4)
        del scores
        ref_graph_ms = graph_ms(lambda: indexer_topk_reference(*ref_args, topk), 3, iters) if cuda else None
        tri_graph_ms = graph_ms(lambda: indexer_topk_triton(*args, topk), 3, iters) if cuda else None
        # A reference run on fewer sequences is scaled up per sequence for the speedup.
        ref_full_ms = ref_ms * batch / ref_b
        key_bytes = batch * context * DIM * keys.element_size()
        rows.append({
            "name": "indexer_topk", "context": context, "batch": batch, "topk": topk,
            "heads": HEADS, "dim": DIM, "block_size": BLOCK,
            "ref_ms": round(ref_ms, 4), "ref_batch": ref_b,
            "triton_ms": round(tri_ms, 4), "score_ms": round(score_ms, 4), "select_ms": round(select_ms, 4),
            "speedup": round(ref_full_ms / tri_ms, 2),
            "ref_graph_ms": ref_graph_ms, "triton_graph_ms": tri_graph_ms,
            "graph_speedup": (round(ref_graph_ms * batch / ref_b / tri_graph_ms, 2)
                              if ref_graph_ms and tri_graph_ms else None),
            "score_GBps": round(key_bytes / score_ms / 1e6, 3),
            "agree": round(agree, 5), "worst_gap": gap, "score_max_err": score_err,
            "score_max_abs": score_mag, **by_method,
        })
        del q, w, keys, tables, lens, args, ref_args, got
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


COLUMNS = ["context", "batch", "topk", "ref_ms", "ref_batch", "triton_ms", "score_ms", "select_ms",
           "select_fused_ms", "select_radix_ms", "select_topk_ms", "speedup", "ref_graph_ms", "triton_graph_ms", "graph_speedup", "score_GBps", "agree",
           "worst_gap", "score_max_err"]


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__.splitlines()[0], COLUMNS, argv)


if __name__ == "__main__":
    main()
