"""Peak GPU memory and time of loading a checkpoint, by routed-expert dtype.

    python -m bench.load_memory --preset bench --fp8-block 128 128 --expert-dtype auto fp8_e4m3

Writes (or reuses) a random checkpoint of the preset under --dir, in DeepSeek's block FP8 layout
with --fp8-block, then loads it once per expert dtype, each in a fresh process so that each peak
holds one model: `engine.checkpoint.load_model`, with `fp8_experts` for fp8_e4m3 (the experts kept
as stored). A JSON line per load: seconds, peak allocated GiB, the loaded weights' GiB.
"""
from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

import torch


def load_once(path: str, expert_dtype: str, dtype: str) -> dict:
    from engine.checkpoint import load_model
    from engine.config import EngineConfig, ModelConfig
    kw = {}
    if hasattr(EngineConfig, "fp8_experts"):  # 'auto' resolved against the checkpoint, as the engine does
        engine = EngineConfig(device="cuda", dtype=dtype, expert_dtype=expert_dtype)
        kw["fp8_experts"] = engine.fp8_experts(ModelConfig.from_file(Path(path)))
    elif "fp8_experts" in inspect.signature(load_model).parameters:  # older trees: 'auto' was 16-bit
        kw["fp8_experts"] = expert_dtype == "fp8_e4m3"
    elif expert_dtype not in ("auto", "model"):
        raise SystemExit("this tree's loader has no FP8 experts")
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    model = load_model(path, device="cuda", dtype=getattr(torch, dtype), progress=False, **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return dict(expert_dtype=expert_dtype, load_s=round(seconds, 2),
                peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3), weights_gib=round(weights / 2**30, 3))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--dir", default="checkpoints")
    ap.add_argument("--fp8-block", type=int, nargs=2, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--expert-dtype", nargs="+", default=["model", "fp8_e4m3"], choices=["auto", "model", "fp8_e4m3"])
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: load this checkpoint once
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(load_once(args.one, args.expert_dtype[0], args.dtype)), flush=True)
        return
    from engine.checkpoint import write_random_checkpoint
    from engine.config import preset
    block = tuple(args.fp8_block) if args.fp8_block else None
    path = Path(args.dir) / (f"{args.preset}-fp8-{block[0]}x{block[1]}" if block else args.preset)
    if not (path / "config.json").exists():
        t = time.perf_counter()
        write_random_checkpoint(preset(args.preset), path, dtype=getattr(torch, args.dtype), device="cuda",
                                fp8_block=block, progress=False)
        print(json.dumps(dict(wrote=str(path), seconds=round(time.perf_counter() - t, 1))), flush=True)
    for expert_dtype in args.expert_dtype:
        out = subprocess.run([sys.executable, "-m", "bench.load_memory", "--one", str(path), "--dtype", args.dtype,
                              "--expert-dtype", expert_dtype], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-2000:], file=sys.stderr)
            continue
        row = dict(json.loads(out.stdout.strip().splitlines()[-1]), preset=args.preset, fp8_block=block)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
