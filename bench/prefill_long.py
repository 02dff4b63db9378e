"""Time to first token of a long prompt with nothing cached, and where a long prefill's device time
goes.

    python -m bench.prefill_long --device cuda --contexts 8192 32768 100000
    python -m bench.prefill_long --device cuda --contexts 32768 --profile prof.txt
    python -m bench.prefill_long --device cpu --preset tiny-v4 --dtype float32 --contexts 256 --chunks 64

Each context is a fresh prompt of random tokens, prefilled in chunks of max_num_batched_tokens
(`--chunks`, several values are timed in turn), then one token sampled. `--profile` records the
whole prefill of the first context under the torch profiler and writes the kernels by device
time, grouped into the parts of a layer (scoring, selection, attention, MoE, GEMMs).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import torch

from bench.engine_vs_hf import build_ours, sync
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from wideep_kernels import tuning

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
# Kernel-name patterns of each part, first match wins (our Triton kernels' names, cuBLAS's).
PARTS = [
    ("index scoring", r"score"),
    ("index selection", r"radix|select|threshold|emit|_topk|hist|maxima"),
    ("attention", r"mla|attn|attention|merge|split_kernel|resolve_slots"),
    ("moe", r"moe|expert|routing|route|swiglu|align|gate_up|_down_kernel|sum_pairs|_offsets_kernel|_count_kernel|"
            r"_place_kernel"),
    ("gemm", r"gemm|gemv|sm90|cutlass|nvjet|ampere|matmul|splitK"),
    ("norm / rope / latent", r"norm|rope|latent"),
]


def part_of(name: str) -> str:
    low = name.lower()
    for part, pattern in PARTS:
        if re.search(pattern, low):
            return part
    return "other"


def prefill_ms(engine: LLMEngine, prompt: list[int], device) -> float:
    sync(device)
    t0 = time.perf_counter()
    engine.generate([prompt], ONE)
    sync(device)
    return 1e3 * (time.perf_counter() - t0)


def make_engine(model, args, chunk: int, context: int) -> LLMEngine:
    bs = 64 if args.device.startswith("cuda") else 16
    blocks = 2 * -(-(context + 64) // bs) + 8
    ecfg = EngineConfig(device=args.device, dtype=args.dtype, block_size=bs, num_blocks=blocks, max_num_seqs=2,
                        max_num_batched_tokens=chunk, enable_prefix_caching=False)
    engine = LLMEngine(model, None, ecfg)
    engine.generate([list(range(4, 4 + 2 * bs))], ONE)
    return engine


def profile_prefill(engine: LLMEngine, prompt: list[int], device, path: str, title: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    cuda = str(device).startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        wall = prefill_ms(engine, prompt, device)
    kernels = {}
    for ev in prof.key_averages():
        # on a CPU the operators' own host time stands in for the kernels'
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0 and ev.key not in kernels:
            kernels[ev.key] = (us, ev.count)
    total = sum(us for us, _ in kernels.values()) or 1.0
    parts: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + us
    with open(path, "a") as f:
        f.write(f"## {title}: {wall:.1f} ms wall under the profiler, {total / 1e3:.1f} ms of kernels\n\n")
        f.write("| part | device ms | share |\n|---|---|---|\n")
        for part, us in sorted(parts.items(), key=lambda kv: -kv[1]):
            f.write(f"| {part} | {us / 1e3:.1f} | {us / total:.1%} |\n")
        f.write("\n| kernel | part | calls | device ms | share |\n|---|---|---|---|---|\n")
        for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]:
            f.write(f"| {name[:90]} | {part_of(name)} | {n} | {us / 1e3:.2f} | {us / total:.1%} |\n")
        f.write("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100000])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024], help="max_num_batched_tokens values to time")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile", default=None, metavar="PATH", help="profile the first context's prefill here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = preset(args.preset, max_position_embeddings=max(max(args.contexts) + 64, 4096))
    model = build_ours(cfg, args.device, getattr(torch, args.dtype))
    g = torch.Generator().manual_seed(0)
    rows = []
    for chunk in args.chunks:
        for context in args.contexts:
            engine = make_engine(model, args, chunk, context)
            prompt = lambda: torch.randint(4, cfg.vocab_size, (context,), generator=g).tolist()  # noqa: E731
            times = [prefill_ms(engine, prompt(), args.device) for _ in range(args.repeats)]
            row = dict(preset=args.preset, device=args.device, context=context, chunk=chunk,
                       ttft_ms=round(min(times), 1), ttft_ms_all=[round(t, 1) for t in times],
                       prompt_tok_s=round(context / min(times) * 1e3),
                       tuned_table=tuning.table_name(torch.device(args.device)))
            if args.profile and chunk == args.chunks[0] and context == args.contexts[0]:
                profile_prefill(engine, prompt(), args.device, args.profile, f"context {context}, chunk {chunk}")
            print(json.dumps(row), flush=True)
            rows.append(row)
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print("\n| context | chunk | TTFT ms (best) | prompt tok/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['chunk']} | {r['ttft_ms']} | {r['prompt_tok_s']} |")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
