"""What a prefill/decode hand-off costs a decoding batch: the decode engine reserving blocks for
a remote prefill's KV between its steps.

    python3 -m bench.handoff_overlap --preset bench --batches 1 16 64          # one GPU
    .venv/bin/python -m bench.handoff_overlap --preset tiny --device cpu --batches 2 --steps 5   # smoke run

A batch decodes with async scheduling (a step always in flight); after every `--every`-th step a
request arrives for which the engine reserves blocks (`reserve_remote`), then is aborted (its
blocks come back at once: the prefill side is not part of this). Two modes, each run on the
same engine one after the other:
- `withhold`: the engine as it is: blocks the step in flight still writes sit out the
  reservation, and the host does not wait;
- `wait`: the host first waits for the step in flight, as the engine did before, so the GPU idles
  while the host completes and launches the next step.
Reports per mode and batch the mean step of runs of 8 steps back to back, without hand-offs
(`base_ms`) and with them (`handoff_ms`), side by side in the same run: the median over the
runs (a decode graph captured as the context grows past a table width lands in one of them),
and their min and max.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.ep_decode import build
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


def timed_steps(engine: LLMEngine, steps: int, every: int, wait: bool, prompt: list[int], cuda: bool,
                chunk: int = 8) -> list[float]:
    """Mean seconds a step of each run of `chunk` steps back to back (the device synchronized
    around each run only); a reservation after every `every`-th step (0: none)."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    means = []
    for first in range(0, steps, chunk):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(first, min(first + chunk, steps)):
            engine.step()
            if every and i % every == 0:
                if wait:
                    engine.wait_inflight()
                rid = f"handoff-{i}"
                if engine.reserve_remote(rid, prompt, params) is None:
                    raise RuntimeError("the pool could not hold the reservation: raise num_blocks")
                engine.abort_request(rid)
        if cuda:
            torch.cuda.synchronize()
        means.append((time.perf_counter() - t0) / (min(first + chunk, steps) - first))
    return means


def _summary(seconds: list[float]) -> dict:
    ms = sorted(1000 * t for t in seconds)
    return {"median": round(statistics.median(ms), 3), "min": round(ms[0], 3), "max": round(ms[-1], 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=128, help="tokens of the decoding prompts and of each hand-off")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=1, help="a hand-off after every this many steps")
    ap.add_argument("--rounds", type=int, default=3, help="the two modes alternate this many times")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    longest = args.prompt + (2 * args.rounds + 1) * 2 * args.steps + 24
    engine = LLMEngine(build(cfg, args.device, dtype), None, EngineConfig(
        device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16,
        max_num_seqs=max(args.batches) + 1, async_scheduling=True, warmup=False, remote_kv_grace_s=0,
        num_blocks=(max(args.batches) + 1) * (longest // 16 + 2) + 16,
        max_num_batched_tokens=(max(args.batches) + 1) * args.prompt))
    g = torch.Generator().manual_seed(0)
    handoff = torch.randint(4, cfg.vocab_size, (args.prompt,), generator=g).tolist()
    report = {"preset": args.preset, "device": args.device, "prompt": args.prompt, "steps": args.steps,
              "every": args.every, "rows": []}
    for batch in args.batches:
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", torch.randint(4, cfg.vocab_size, (args.prompt,), generator=g).tolist(),
                               SamplingParams(max_tokens=longest - args.prompt - 8, temperature=0, ignore_eos=True))
        for _ in range(6):  # prefill, then the first decode steps (graph capture)
            engine.step()
        times = {"withhold": [], "wait": []}
        ahead = dict.fromkeys(times, 0)
        for _ in range(args.rounds):
            for mode in times:
                base = timed_steps(engine, args.steps, 0, False, handoff, cuda)
                ahead0 = engine.num_steps_ahead
                with_handoffs = timed_steps(engine, args.steps, args.every, mode == "wait", handoff, cuda)
                ahead[mode] += engine.num_steps_ahead - ahead0
                times[mode].append((base, with_handoffs))
        for mode, pairs in times.items():
            base = [t for b, _ in pairs for t in b]
            with_handoffs = [t for _, h in pairs for t in h]
            row = {"mode": mode, "batch": batch,
                   "base_ms": _summary(base), "handoff_ms": _summary(with_handoffs),
                   "handoff_steps_ahead": ahead[mode], "handoff_steps": args.rounds * args.steps}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        for rid in list(engine.requests):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
