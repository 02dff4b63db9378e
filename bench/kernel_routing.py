"""Fused MoE routing kernel vs the unfused torch sequence (route + slots_for + slot count).

DeepSeek-V3 routing: E=256 experts in 8 groups, 4 groups eligible, top-8, plus 32 redundant
slots (288 physical slots, as after an EPLB re-placement). Both run on the same inputs in the
same process; each row also checks the kernel's result against the reference.

eager columns time one call from the host (launch overhead included: what an eager decode
step pays); graph columns replay a CUDA graph of one call (GPU time only: what a graph-captured
decode step pays). Median of the iterations, CUDA events.

    python -m bench.kernel_routing --device cuda --json bench/out/kernel_routing.json
    python -m bench.kernel_routing --device cpu --quick      # TRITON_INTERPRET=1 smoke
"""
from __future__ import annotations

import os

import torch

from bench.kernel_timing import bench_main, graph_ms, time_ms

EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, REDUNDANT = 256, 8, 4, 8, 32
SCALING = 2.5


def _expert_map(seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    phys = list(range(EXPERTS)) + torch.randint(0, EXPERTS, (REDUNDANT,), generator=g).tolist()
    phys = [phys[i] for i in torch.randperm(len(phys), generator=g).tolist()]
    num_replicas = torch.bincount(torch.tensor(phys), minlength=EXPERTS)
    log2phys = torch.full((EXPERTS, int(num_replicas.max())), -1, dtype=torch.long)
    fill = [0] * EXPERTS
    for slot, e in enumerate(phys):
        log2phys[e, fill[e]] = slot
        fill[e] += 1
    return log2phys, num_replicas, len(phys)


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before wideep_kernels.routing imports triton
    from wideep_kernels.routing import route_reference, route_triton

    cuda = device.startswith("cuda")
    token_counts = [4, 16] if quick else [16, 32, 64, 128, 256]
    warmup, iters = (1, 3) if quick else (10, 50)
    log2phys, num_replicas, num_slots = _expert_map(0)
    log2phys, num_replicas = log2phys.to(device), num_replicas.to(device)
    rows = []
    for t in token_counts:
        g = torch.Generator().manual_seed(t)
        logits = torch.randn(t, EXPERTS, generator=g).to(device)
        bias = (torch.randn(EXPERTS, generator=g) * 0.1).to(device)
        args = (logits, bias, N_GROUP, TOPK_GROUP, TOP_K, True, SCALING, log2phys, num_replicas)

        load_ref = torch.zeros(num_slots, dtype=torch.long, device=device)
        load_tri = torch.zeros_like(load_ref)
        ids_r, w_r, s_r = route_reference(*args, load_ref)
        ids_t, w_t, s_t = route_triton(*args, load_tri)
        row = {
            "name": "fused_route", "T": t, "E": EXPERTS, "groups": f"{N_GROUP}/{TOPK_GROUP}", "top_k": TOP_K,
            "slots": num_slots,
            "max_abs_err": float((w_t - w_r).abs().max()),
            "ids_equal": float((ids_t == ids_r).float().mean()),
            "slots_equal": float((s_t == s_r).float().mean()),
            "load_equal": bool(torch.equal(load_ref, load_tri)),
        }
        ref_fn = lambda: route_reference(*args, load_ref)  # noqa: E731
        tri_fn = lambda: route_triton(*args, load_tri)  # noqa: E731
        row["ref_ms"] = time_ms(ref_fn, device, warmup, iters)
        row["triton_ms"] = time_ms(tri_fn, device, warmup, iters)
        row["speedup"] = row["ref_ms"] / row["triton_ms"]
        if cuda:
            row["ref_graph_ms"] = graph_ms(ref_fn, warmup, iters)
            row["triton_graph_ms"] = graph_ms(tri_fn, warmup, iters)
            row["graph_speedup"] = row["ref_graph_ms"] / row["triton_graph_ms"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
