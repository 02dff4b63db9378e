"""Decode step time of one expert-parallel rank against the same model without expert parallelism.

    python3 -m bench.ep_decode --preset bench --batches 1 16 64            # one GPU: a group of one NCCL rank
    .venv/bin/python -m bench.ep_decode --preset tiny --device cpu --batches 4 --steps 5   # smoke run

Modes, each on a fresh model in the same process, one after the other:
- `plain`: the engine without expert parallelism (decode graphs as configured);
- `ep`: the engine as rank 0 of a one-rank expert-parallel group (NCCL on GPU, gloo on CPU):
  every step agrees on its shape on the host (shared memory) and every MoE layer runs the
  all-gather, routing of the gathered rows and reduce-scatter, replayed from decode graphs where
  the engine captures them; decode steps are launched ahead (async scheduling), as the decode
  group's ranks run;
- `ep-nccl`: the same with the agreement over the NCCL group, which waits for the GPU: no step
  is launched ahead;
- `ep-eager`: `ep` with `cuda_graphs` off.
With one rank the collectives move nothing between GPUs: what the `ep` rows show is the
overhead of the expert-parallel step itself (agreement, collectives, fixed shapes) against
`plain`. Reports per mode and batch the median and max decode step (ms), each step timed up to
the GPU's end of it (`p50_ms`: no overlap with the next step), and the mean step of a run of
steps timed as a whole (`run_ms`, `tok_s`: what async scheduling gains shows here);
with `--mixed N`, also the median over N new prompts, each arriving beside the decoding batch, of
the two steps after it (one computes the prompt beside the decodes; with expert parallelism that
step replays a chunk graph on every rank). `start_s` is the engine's construction (its warm-up with
`--warmup`) and `first_6_steps_s` the prefill and first decode steps of each batch, which meet the
kernel builds and graph captures the warm-up did not make.
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist

from bench.kernel_timing import write_kernel_table
from engine.checkpoint import load_weights, random_weights
from engine.config import EngineConfig, preset
from engine.ep import ExpertParallel, GroupStep, initial_placement
from engine.host_agreement import host_exchange
from engine.llm_engine import LLMEngine
from engine.model import DeepseekForCausalLM
from engine.sampling import SamplingParams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(cfg, device: str, dtype: torch.dtype, local_phys2log=None) -> DeepseekForCausalLM:
    with torch.device(device):
        model = DeepseekForCausalLM(cfg, device=device, local_phys2log=local_phys2log).to(dtype)
    for moe in model.moe_layers():
        moe.gate.float()
    load_weights(model, random_weights(cfg, seed=0, device=device, dtype=dtype), progress=False)
    return model.eval()


def measure(engine: LLMEngine, batch: int, prompt: int, steps: int, vocab: int, cuda: bool,
            profile_path: str | None = None, title: str = "", mixed: int = 0) -> dict:
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", torch.randint(4, vocab, (prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=2 * steps + 16, temperature=0, ignore_eos=True))

    def step() -> float:
        t0 = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    # prefill, then the first decode steps (graph captures, and kernel builds where the engine
    # did not warm up): what a fresh engine's first requests wait for
    first = sum(step() for _ in range(6))
    times = [step() for _ in range(steps)]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    run = (time.perf_counter() - t0) / steps
    kernels = profile_step(engine, profile_path, title) if profile_path else None
    # A prompt arriving while the batch decodes: the two steps after it, one of which computes the
    # prompt beside the decodes (which one depends on async scheduling, which the plain engine has).
    arrivals = []
    for i in range(mixed):
        engine.add_request(f"b{batch}-new{i}", torch.randint(4, vocab, (prompt,), generator=g).tolist(),
                           SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        arrivals.append(step() + step())
        step()  # a decode step between arrivals
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    row = {"first_6_steps_s": round(first, 3),
           "p50_ms": round(1000 * statistics.median(times), 3), "max_ms": round(1000 * max(times), 3),
           "run_ms": round(1000 * run, 3), "tok_s": round(batch / run, 1)}
    if arrivals:
        row["mixed_2_steps_p50_ms"] = round(1000 * statistics.median(arrivals), 3)
    return row if kernels is None else {**row, "eager_kernels": kernels}


def profile_step(engine: LLMEngine, path: str, title: str) -> int:
    """Profile one whole decode step run eagerly (graphs hide their kernels from the profiler),
    the agreement and sampling included; append its kernels by device time to `path` and return
    how many it launched. Dependent launches are off for it (wideep_kernels/pdl.py)."""
    from torch.profiler import ProfilerActivity, profile

    from wideep_kernels import pdl
    runner = engine.runner
    graphs, runner.graphs = runner.graphs, None
    mode, pdl.MODE = pdl.MODE, 0
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            engine.step()
            if runner.device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        runner.graphs, pdl.MODE = graphs, mode
    return write_kernel_table(prof, path, title, row_limit=40)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--modes", nargs="+", default=["plain", "ep", "ep-nccl", "ep-eager"],
                    choices=["plain", "ep", "ep-nccl", "ep-eager"])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--mixed", type=int, default=0,
                    help="then this many new prompts arrive one at a time beside the decoding batch: time the "
                         "two steps after each")
    ap.add_argument("--warmup", action="store_true",
                    help="warm the engines up as at start (EngineConfig.warmup; on GPU), and report its seconds")
    ap.add_argument("--profile", default=None,
                    help="append a kernel table of one eagerly run decode step per mode and batch to this file")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    exchange = None
    if any(m != "plain" for m in args.modes):
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, **({"device_id": torch.device("cuda:0")} if cuda else {}))
        # as a decode group's ranks on one host agree (engine/host_agreement.py): shared memory
        exchange = host_exchange(0, 1, GroupStep.WIDTH, dist.new_group(backend="gloo")) if cuda else None
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    longest = args.prompt + 2 * args.steps + 24
    report = {"preset": args.preset, "device": args.device, "prompt": args.prompt, "steps": args.steps, "rows": []}
    for mode in args.modes:
        ep = None
        if mode != "plain":
            ep = ExpertParallel(0, 1, initial_placement(layers, cfg.n_routed_experts, cfg.n_routed_experts),
                                cfg.n_routed_experts, group=dist.group.WORLD,
                                exchange=None if mode == "ep-nccl" else exchange)
        model = build(cfg, args.device, dtype, ep.local_phys2log() if ep is not None else None)
        t0 = time.perf_counter()
        engine = LLMEngine(model, None, EngineConfig(
            device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16,
            max_num_seqs=max(args.batches) + args.mixed, cuda_graphs=mode != "ep-eager", warmup=args.warmup,
            num_blocks=(max(args.batches) + args.mixed) * (longest // 16 + 2) + 16,
            max_num_batched_tokens=(max(args.batches) + 1) * args.prompt), ep=ep)
        start_s = round(time.perf_counter() - t0, 2)  # the engine's construction, its warm-up included
        for batch in args.batches:
            row = {"mode": mode, "batch": batch, "start_s": start_s,
                   **measure(engine, batch, args.prompt, args.steps, cfg.vocab_size, cuda, args.profile,
                             f"{mode}, batch {batch}", args.mixed)}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        del engine, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
