"""TTFT of an agent's next turn after a prefix-cache hit: bounded window replay vs exact vs none.

    python -m bench.replay_ttft --device cuda --contexts 8192 32768 100000
    python -m bench.replay_ttft --device cpu --preset tiny-v4 --dtype float32 --contexts 256 1024   # smoke

Every turn sends the same `context` tokens plus `--new-tokens` new ones and is timed to its
first token, on one engine:
- none: the first turn, nothing cached: the whole prompt is prefilled;
- bounded: a prefix hit replays only the last W positions' window KV (the default);
- exact: it replays W x layers positions, far enough that every window entry equals a cold run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.engine_vs_hf import build_ours, sync
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def ttft(engine: LLMEngine, prompt: list[int], device) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.generate([prompt], ONE)
    sync(device)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100000])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = preset(args.preset, max_position_embeddings=max(max(args.contexts) + args.new_tokens + 16, 4096))
    model = build_ours(cfg, args.device, getattr(torch, args.dtype))
    bs = 64 if args.device.startswith("cuda") else 16
    g = torch.Generator().manual_seed(0)
    rows = []
    # A first, unrecorded pass at a short context: the Triton kernels compile a variant per
    # shape class on first use, which would otherwise land in the first measured turns.
    for i, context in enumerate([min(2048, min(args.contexts))] + args.contexts):
        base = torch.randint(4, cfg.vocab_size, (context,), generator=g).tolist()
        turn = lambda: base + torch.randint(4, cfg.vocab_size, (args.new_tokens,), generator=g).tolist()  # noqa: E731
        row = dict(preset=args.preset, device=args.device, context=context, new_tokens=args.new_tokens)
        blocks = 2 * -(-(context + args.new_tokens * (2 * args.repeats + 2)) // bs) + 8
        ecfg = EngineConfig(device=args.device, dtype=args.dtype, block_size=bs, num_blocks=blocks, max_num_seqs=2,
                            max_num_batched_tokens=args.chunk)
        engine = LLMEngine(model, None, ecfg)
        engine.generate([list(range(4, 4 + 2 * bs))], ONE)  # warm-up, shares no block with `base`
        # No cache: the first turn prefills everything (the same length as the later turns).
        row["none_ttft_ms"] = round(1e3 * ttft(engine, turn(), args.device), 1)
        for mode in ("bounded", "exact"):
            engine.cfg.replay_mode = mode  # the scheduler reads it at each admission
            times, replayed = [], []
            for _ in range(args.repeats):
                before = engine.scheduler.replayed_tokens
                times.append(ttft(engine, turn(), args.device))
                replayed.append(engine.scheduler.replayed_tokens - before)
            row[f"{mode}_ttft_ms"] = round(1e3 * statistics.median(times), 1)
            row[f"{mode}_replayed"] = replayed[-1]
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        row["bounded_vs_exact"] = round(row["bounded_ttft_ms"] / row["exact_ttft_ms"] - 1, 3)
        row["bounded_vs_none"] = round(row["bounded_ttft_ms"] / row["none_ttft_ms"] - 1, 3)
        if i == 0:
            continue
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| context | bounded ms | exact ms | no cache ms | bounded vs exact | bounded vs no cache |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['bounded_ttft_ms']} | {r['exact_ttft_ms']} | {r['none_ttft_ms']} | "
              f"{r['bounded_vs_exact']:+.0%} | {r['bounded_vs_none']:+.0%} |")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
