"""Expert-parallel decode with a live full re-placement, measured step by step.

    python3 -m bench.eplb_migration --preset bench --device cuda --ranks 2      # 2 GPUs of one host
    .venv/bin/python -m bench.eplb_migration --preset tiny --device cpu --ranks 2 --batch 4   # smoke run

Each rank (a process; NCCL on GPU, gloo on CPU) decodes `batch` requests in lockstep with the
others. Routing is skewed on purpose: the correction bias of every MoE layer is raised by
`--skew` for the experts of the first expert group, so their rank gets most tokens. After
`--steps` measured steps the ranks plan a full re-placement from the measured loads (the
hierarchical policy, from scratch), stage the incoming experts (CUDA IPC peer copies on a
side stream on GPU; gloo send/recv on CPU) while decode goes on, switch at a step they all
agree on, and decode `--steps` more. Reports step time p50/max before, during and after the
migration, the migration's wall time, bytes and GB/s (against a plain peer copy measured in
the same run on GPU), the measured imbalance and decode tokens/s before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.checkpoint import load_weights, random_weights
from engine.config import EngineConfig, preset
from engine.ep import ExpertParallel, initial_placement
from engine.eplb_policy import imbalance, rebalance
from engine.llm_engine import LLMEngine
from engine.model import DeepseekForCausalLM
from engine.sampling import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_copy_gib_s(gib: float = 2.0) -> float | None:
    """Plain cuda:0 -> cuda:1 copy bandwidth, the yardstick for staging."""
    if torch.cuda.device_count() < 2:
        return None
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    dst.copy_(src)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    bw = 5 * n / (time.perf_counter() - t0) / 2**30
    del src, dst
    torch.cuda.empty_cache()
    return bw


def stats_ms(times: list[float]) -> dict:
    if not times:
        return {"n": 0}
    return {"n": len(times), "p50_ms": round(1000 * statistics.median(times), 2),
            "max_ms": round(1000 * max(times), 2), "mean_ms": round(1000 * statistics.mean(times), 2)}


def worker(rank: int, args, port: int, results):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = f"cuda:{rank}" if cuda else "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, **({"device_id": torch.device(device)} if cuda else {}))
    migrate = dist.new_group(backend="gloo")
    cfg = preset(args.preset)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    num_slots = cfg.n_routed_experts + args.redundant
    ep = ExpertParallel(rank, args.ranks, initial_placement(layers, cfg.n_routed_experts, num_slots),
                        cfg.n_routed_experts, group=dist.group.WORLD, migrate_group=migrate)
    dtype = torch.bfloat16 if cuda else torch.float32
    with torch.device(device):
        model = DeepseekForCausalLM(cfg, device=device, local_phys2log=ep.local_phys2log()).to(dtype)
    for moe in model.moe_layers():
        moe.gate.float()
    load_weights(model, random_weights(cfg, seed=0, device=device, dtype=dtype), progress=False)
    per_group = cfg.n_routed_experts // cfg.n_group
    for moe in model.moe_layers():  # the skew: the first expert group is everyone's favourite
        moe.gate.e_score_correction_bias[:per_group] += args.skew
    model.eval()
    engine = LLMEngine(model, None, EngineConfig(
        device=device, dtype="bfloat16" if cuda else "float32", block_size=16, max_num_seqs=args.batch,
        num_blocks=args.batch * ((args.prompt + 3 * args.steps + 64) // 16 + 2),
        max_num_batched_tokens=args.batch * args.prompt), ep=ep)
    if cuda:
        ep.share_weights()
    g = torch.Generator().manual_seed(rank)
    for i in range(args.batch):
        engine.add_request(f"r{rank}-{i}", torch.randint(4, cfg.vocab_size, (args.prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))

    def step() -> float:
        t0 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(5):  # prefill and warm-up
        step()
    ep.take_load()
    before = [step() for _ in range(args.steps)]
    slot_load = torch.cat(_all_gather(ep.take_load(), migrate), dim=1)
    logical = torch.zeros(layers, cfg.n_routed_experts, dtype=torch.long).scatter_add_(1, ep.phys2log, slot_load)
    t_plan = time.perf_counter()
    proposed = rebalance(logical, num_slots=num_slots, num_ranks=args.ranks, num_groups=cfg.n_group)
    plan_s = time.perf_counter() - t_plan
    imb_before = imbalance(slot_load, num_ranks=args.ranks)

    t_mig = time.perf_counter()
    ep.stage("full", proposed.phys2log, delay_s=args.stage_delay)
    during = []
    while not ep.pending.done.is_set():
        during.append(step())
    staged = ep.wait_staged("full", 60)
    staging_s = time.perf_counter() - t_mig
    ep.commit("full")
    while ep.switches == 0:
        during.append(step())
    migration_s = time.perf_counter() - t_mig
    ep.take_load()
    after = [step() for _ in range(args.steps)]
    slot_after = torch.cat(_all_gather(ep.take_load(), migrate), dim=1)
    moved_bytes = sum(_all_gather(torch.tensor([staged.get("bytes", 0)]), migrate)).item()
    if rank == 0:
        tok_s = lambda times: round(args.batch * args.ranks / statistics.mean(times), 1)  # noqa: E731
        results.put({
            "preset": args.preset, "device": args.device, "ranks": args.ranks, "batch_per_rank": args.batch,
            "skew": args.skew, "experts_moved": int((proposed.phys2log != initial_placement(
                layers, cfg.n_routed_experts, num_slots)).sum()),
            "plan_s": round(plan_s, 4), "staging_s": round(staging_s, 4), "migration_s": round(migration_s, 4),
            "bytes_moved": int(moved_bytes), "staging_GiB_s": round(moved_bytes / staging_s / 2**30, 2),
            "step_before": stats_ms(before), "step_during": stats_ms(during), "step_after": stats_ms(after),
            "max_during_over_p50_before": round(max(during) / statistics.median(before), 3) if during else None,
            "imbalance_before": round(float(imb_before.mean()), 3),
            "imbalance_after": round(float(imbalance(slot_after, num_ranks=args.ranks).mean()), 3),
            "tok_s_before": tok_s(before), "tok_s_after": tok_s(after), "staged": staged})
    dist.barrier(group=migrate)
    dist.destroy_process_group()


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="requests per rank")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skew", type=float, default=0.3)
    ap.add_argument("--redundant", type=int, default=0)
    ap.add_argument("--stage-delay", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    peer = peer_copy_gib_s() if args.device == "cuda" else None
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    report = results.get(timeout=900)
    for p in procs:
        p.join(timeout=60)
    report["peer_copy_GiB_s"] = peer and round(peer, 1)
    if peer:
        report["staging_vs_peer_copy"] = round(report["staging_GiB_s"] / peer, 3)
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")
    os._exit(0)


if __name__ == "__main__":
    main()
