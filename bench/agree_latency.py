"""Host time of one step's agreement in an expert-parallel group (ExpertParallel.agree on the
host, engine/host_agreement.py), for groups of several sizes on one host, in both forms: `gloo`
(an all-gather over a gloo group, any hosts) and `shm` (shared memory, one host).

    python3 -m bench.agree_latency --worlds 2 4 8 --iters 2000

Each rank is a process that calls `agree` back to back, as lockstep ranks do once a step; the
agreement is on the critical path of the host, not the GPU's, once steps run ahead (a step is
agreed while the one before runs), so it matters where it exceeds the GPU's step. Reports the
median, 90th percentile and max microseconds of rank 0's calls per form and group size. Needs
a core per rank to mean anything.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, iters: int, form: str, per_host: int, results) -> None:
    import torch
    import torch.distributed as dist

    import engine.shm_pool as shm_pool
    from engine.ep import ExpertParallel, GroupStep, initial_placement
    from engine.host_agreement import GlooExchange, host_exchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        agree = dist.new_group(backend="gloo")
        if form == "hosts":
            shm_pool.host_id = lambda: f"host-{rank // per_host}"
        exchange = (GlooExchange(agree, world) if form == "gloo" else
                    host_exchange(rank, world, GroupStep.WIDTH, agree, address="127.0.0.1"))
        ep = ExpertParallel(rank, world, initial_placement(1, world, world), world, group=dist.group.WORLD,
                            exchange=exchange)
        ep.attach([])
        times = []
        for i in range(iters + 100):  # the first 100: connections warming up
            t0 = time.perf_counter()
            step = ep.agree(rows=1 + (i + rank) % 16, graph=True, width=64, sparse=False, chunk=True)
            times.append(time.perf_counter() - t0)
            assert step.rows >= 1
        if rank == 0:
            results.put(times[100:])
    finally:
        dist.destroy_process_group()


def measure(world: int, iters: int, form: str, per_host: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, iters, form, per_host, results)) for r in range(world)]
    for p in procs:
        p.start()
    times = sorted(results.get(timeout=600))
    for p in procs:
        p.join(timeout=60)
    us = [1e6 * t for t in times]
    layout = {"ranks_per_host": per_host} if form == "hosts" else {}
    return {"form": form, "world": world, **layout, "iters": iters, "p50_us": round(statistics.median(us), 1),
            "p90_us": round(us[int(0.9 * len(us))], 1), "max_us": round(us[-1], 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--forms", nargs="+", default=["shm", "gloo"], choices=["shm", "gloo", "hosts"])
    ap.add_argument("--ranks-per-host", type=int, default=2, help="form `hosts`: ranks of each fake host")
    args = ap.parse_args(argv)
    for form in args.forms:
        for world in args.worlds:
            print(json.dumps(measure(world, args.iters, form, args.ranks_per_host)), flush=True)


if __name__ == "__main__":
    main()
