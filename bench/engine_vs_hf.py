"""Decode throughput of our engine against transformers `generate`, same weights, side by side.

    python -m bench.engine_vs_hf --preset tiny --device cpu --batches 1 8
    python -m bench.engine_vs_hf --preset bench --device cuda --dtype bfloat16 --batches 1 16 64

transformers only knows DeepSeek-V3, so the comparison runs the preset with the V4.1-style
options off (same weights minus the indexer's); our engine is also timed with them on.
Tokens/s = batch x generated tokens / wall time of the whole generation (prompt included;
prompts are short so decode dominates). Decode tokens/s (`*_decode_tok_s`, `decode_ratio`) leave
the prefill out, the same way for both engines: the tokens after the first over the whole
generation's time less a one-token generation's. Our engine runs as configured by default (on GPU, with
async scheduling); `--sync-too` also times it stepping one forward at a time. Writes a JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from engine.checkpoint import load_weights, random_weights
from engine.config import EngineConfig, ModelConfig, preset
from engine.llm_engine import LLMEngine
from engine.model import DeepseekForCausalLM
from engine.sampling import SamplingParams

V3_OFF = dict(kv_source_layer_ids=None, sliding_window=None, index_topk=None)


def build_ours(cfg: ModelConfig, device, dtype, seed=0) -> DeepseekForCausalLM:
    with torch.device(device):
        model = DeepseekForCausalLM(cfg, device=device).to(dtype)
    for moe in model.moe_layers():
        moe.gate.float()
    load_weights(model, random_weights(cfg, seed=seed, device=device, dtype=dtype), progress=False)
    return model.eval()


def build_hf(cfg: ModelConfig, device, dtype, seed=0):
    """transformers' model with the very weights build_ours(cfg, seed) makes (built one at a
    time, so each peak-memory figure holds one model)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                 if k not in ("architectures", "model_type")})
    with torch.device(device):
        hf = DeepseekV3ForCausalLM(hf_cfg).to(dtype)
    ours = build_ours(cfg, device, dtype, seed)
    state = {}
    for name, t in ours.state_dict().items():
        name = name.replace("mlp.w13", "mlp.experts.gate_up_proj").replace("mlp.w2", "mlp.experts.down_proj")
        state[name] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping to transformers failed: missing={missing[:4]} unexpected={unexpected[:4]}")
    del ours, state
    return hf.eval()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_cache(device):
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def peak_reset(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def time_ours(model, batch, prompt_len, gen, device, dtype_name, repeats=2, async_scheduling=None,
              profile_path=None, max_chunk=None):
    bs = 16
    blocks = batch * (-(-(prompt_len + gen + 1) // bs)) + 8
    cfg = EngineConfig(device=str(device), dtype=dtype_name, block_size=bs, num_blocks=blocks, max_num_seqs=batch,
                       max_num_batched_tokens=max(batch * prompt_len, 512), enable_prefix_caching=False,
                       async_scheduling=async_scheduling,
                       **({} if max_chunk is None else {"cuda_graph_max_chunk": max_chunk}))
    engine = LLMEngine(model, None, cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, model.cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    best, best_steps = float("inf"), []
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out
    engine.step = timed_step
    for _ in range(repeats):
        peak_reset(device)
        sync(device)
        steps = []
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        sync(device)
        if time.perf_counter() - t0 < best:
            best, best_steps = time.perf_counter() - t0, steps
        assert all(len(o.output_token_ids) == gen for o in outs)
    # The first step prefills (and, run ahead, launches the first decode step); each later one
    # returns one decode step's tokens.
    step_ms = dict(first_step_ms=round(best_steps[0] * 1e3, 3),
                   decode_step_ms=round(statistics.median(best_steps[1:]) * 1e3, 3))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    step_ms["decode_tok_s"] = round(decode_rate(batch, gen, best, lambda: engine.generate(prompts, one), device,
                                                repeats), 1)
    if profile_path:
        profile_first_step(engine, prompts, profile_path, f"batch {batch}, prompt {prompt_len}")
    return batch * gen / best, peak_gib(device), engine.runner.kv.nbytes() / 2**30, step_ms


def decode_rate(batch, gen, best_full_s, generate_one, device, repeats) -> float:
    """Decode tokens/s alone: the generated tokens after the first, over the best whole
    generation's time less the best time of a generation of one token (the prefill, sampling
    and the call's own overhead), measured here the same way for both engines."""
    best_one = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        generate_one()
        sync(device)
        best_one = min(best_one, time.perf_counter() - t0)
    return batch * (gen - 1) / (best_full_s - best_one)


def profile_first_step(engine, prompts, path, title):
    """Profile a generate of one token per prompt (the prefill step, with its sampling): by
    self host time, where the host's share of a step shows, and by device time."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.runner.device.type == "cuda" else [])
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(prompts, one)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, one)
        sync(engine.runner.device)
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    with open(path, "a") as f:
        f.write(f"## {title}: {wall * 1e3:.2f} ms wall under the profiler\n")
        for key in ("self_cpu_time_total", "cuda_time_total"):
            f.write(f"### by {key}\n" + table.table(sort_by=key, row_limit=40, max_name_column_width=60) + "\n\n")


@torch.inference_mode()
def time_hf(hf, batch, prompt_len, gen, device, vocab, repeats=2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (batch, prompt_len), generator=g).to(device)
    kw = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=0)
    hf.generate(ids[:1], **dict(kw, max_new_tokens=4, min_new_tokens=4))
    best = float("inf")
    for _ in range(repeats):
        peak_reset(device)
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(ids, **kw)
        sync(device)
        best = min(best, time.perf_counter() - t0)
        assert out.shape[1] == prompt_len + gen
    peak = peak_gib(device)
    one = dict(kw, max_new_tokens=1, min_new_tokens=1)
    return batch * gen / best, peak, decode_rate(batch, gen, best, lambda: hf.generate(ids, **one), device, repeats)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--sync-too", action="store_true",
                    help="also time our engine stepping one forward at a time (async_scheduling off)")
    ap.add_argument("--max-chunk", type=int, default=None,
                    help="our EngineConfig.cuda_graph_max_chunk (default: the config's)")
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument("--profile-prefill", default=None, metavar="PATH",
                    help="after timing, profile our engine's first step (the prefill) at each batch, host and "
                         "device, and append the tables here")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    results = []
    v3 = preset(args.preset, **V3_OFF)
    v4 = preset(args.preset)
    variants = [("v3", v3)] + ([("v4", v4)] if v4 != v3 else [])
    for label, cfg in variants:
        ours = build_ours(cfg, args.device, dtype)
        rows = []
        for b in args.batches:
            tps, peak, kv_gib, step_ms = time_ours(ours, b, args.prompt_len, args.gen, args.device, args.dtype,
                                                   profile_path=args.profile_prefill, max_chunk=args.max_chunk)
            rows.append(dict(preset=args.preset, mode=label, batch=b, device=args.device, dtype=args.dtype,
                             prompt_len=args.prompt_len, gen=args.gen, ours_tok_s=round(tps, 1),
                             ours_peak_gib=peak and round(peak, 2), ours_kv_pool_gib=round(kv_gib, 3),
                             **{f"ours_{k}": v for k, v in step_ms.items()}))
            if args.sync_too:
                sync_tps = time_ours(ours, b, args.prompt_len, args.gen, args.device, args.dtype,
                                     async_scheduling=False)[0]
                rows[-1].update(ours_sync_tok_s=round(sync_tps, 1), async_gain=round(tps / sync_tps, 3))
        del ours
        free_cache(args.device)
        if label == "v3" and not args.skip_hf:
            hf = build_hf(cfg, args.device, dtype)
            for row in rows:
                htps, hpeak, hdec = time_hf(hf, row["batch"], args.prompt_len, args.gen, args.device, cfg.vocab_size)
                row.update(hf_tok_s=round(htps, 1), hf_peak_gib=hpeak and round(hpeak, 2),
                           ratio=round(row["ours_tok_s"] / htps, 2), hf_decode_tok_s=round(hdec, 1),
                           decode_ratio=round(row["ours_decode_tok_s"] / hdec, 2))
            del hf
            free_cache(args.device)
        for row in rows:
            print(json.dumps(row), flush=True)
        results += rows
    if args.out:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
