"""The fused MoE kernels' tile shapes, timed side by side on the decode shapes of the bench model
(H=2048, I=768, 64 slots, top-6, plus the shared expert as one more slot). Each call is replayed
from a CUDA graph and checked against the reference. The gate-up kernel's shapes are swept with
the down kernel's built-in one, then the down kernel's with the best gate-up shape.

    python -m bench.probe_moe --json moe.jsonl
    python -m bench.probe_moe --prefill --json moe.jsonl   # chunk shapes: 512 and 2048 tokens, each swept

`--fp8` quantizes the experts to block FP8 (128 x 128 blocks, wideep_kernels/fp8_blocks.py) and times the
kernels on them, with the 16-bit weights' built-in shapes timed in the same run beside them.

`--prefill` sweeps wider tiles and the row tile itself (`--block-m`), at prompt-chunk sizes.

`--act-fp8` (with `--fp8`) quantizes the activations too, per token per 128 columns, for the FP8
tensor cores; the FP8-weight kernels with 16-bit activations are timed beside them.

`--model dsv3` times DeepSeek-V3's layer shape instead (H=7168, I=2048, 32 local slots, top-8:
one GPU's share of the 256 experts over 8).

`--kernels` also profiles the built-in shapes' call (eager, torch.profiler): each launch's GPU time,
and how the tensor-core products of each Triton build were compiled (wgmma or mma.sync).

`--gate` also times the router's partial-logits kernel (wideep_kernels/routing.py) by how many parts
it splits the hidden size into and its tokens, experts and warps a program, 16 calls a CUDA
graph replay (`--gate-only`: that alone).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from bench.kernel_moe_gemm import BENCH_MODEL, DEEPSEEK_V3, make_inputs, relative_error
from bench.kernel_timing import graph_ms
from wideep_kernels.fp8_blocks import quantize_experts
from wideep_kernels.moe_gemm import fused_experts_reference, fused_experts_triton, pick_config

SHAPES = [(n, w, s) for n in (32, 64, 128) for w in (64, 128, 256) for s in (4, 8) if n * w <= 128 * 128 or s == 8]
# (BLOCK_N, BLOCK_K, num_warps) for compute-bound chunks: wider column tiles, shallower k steps
PREFILL_SHAPES = [(n, k, w) for n in (64, 128, 256) for k in (32, 64, 128) for w in (4, 8) if n * k <= 256 * 64]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 64 16 1; 512 2048 with --prefill (each swept)")
    ap.add_argument("--stages", type=int, nargs="+", default=None, help="default 3 4 5; 3 4 with --prefill")
    ap.add_argument("--prefill", action="store_true", help="chunk shapes: wide tiles, and the row tile swept")
    ap.add_argument("--block-m", type=int, nargs="+", default=None,
                    help="row tiles to sweep (default: the built-in one; 64 128 with --prefill)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--model", default="bench", choices=["bench", "dsv3"], help="the layer shape")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts (and the 16-bit ones' built-in shapes beside)")
    ap.add_argument("--act-fp8", action="store_true", help="with --fp8: FP8 activations too (w8a8)")
    ap.add_argument("--fp8-acc", type=int, default=None,
                    help="moe_gemm.FP8_PRECISE_ACC for --act-fp8 (0, the default: into fp32 once a k step)")
    ap.add_argument("--built-in-only", action="store_true", help="no sweep: the built-in shapes alone")
    ap.add_argument("--pair-rows-ab", action="store_true",
                    help="also time the built-in shapes with the other output form (pair rows or fp32 atomics)")
    ap.add_argument("--kernels", action="store_true", help="profile the built-in call: us a launch, the MMA form")
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--gate-only", action="store_true", help="time the router's kernel alone")
    args = ap.parse_args(argv)
    if args.fp8_acc is not None:
        import wideep_kernels.moe_gemm
        wideep_kernels.moe_gemm.FP8_PRECISE_ACC = args.fp8_acc
    args.tokens = args.tokens or ([512, 2048] if args.prefill else [64, 16, 1])
    args.stages = args.stages or ([3, 4] if args.prefill else [3, 4, 5])
    if args.prefill and args.block_m is None:
        args.block_m = [64, 128]
    shapes = PREFILL_SHAPES if args.prefill else SHAPES
    rows, best = [], None
    if args.gate or args.gate_only:
        rows += gate_parts_times(args.tokens, args.iters)
    if args.gate_only:
        args.tokens = []
    for tokens in args.tokens:
        model = DEEPSEEK_V3 if args.model == "dsv3" else BENCH_MODEL
        x, w13, w2, _, slot_of, weight_of = make_inputs(dict(model, tokens=tokens), "cuda", torch.bfloat16)
        g = torch.Generator().manual_seed(7)
        shared = ((torch.randn(w13.shape[1:], generator=g) * model["hidden"] ** -0.5).to(w13),
                  (torch.randn(w2.shape[1:], generator=g) * model["inter"] ** -0.5).to(w2))
        scales = None
        if args.fp8:
            bf16 = (w13, w2, shared)
            built_bf16 = pick_config(slot_of.numel(), w13.shape[0], w13.dtype)
            w13, w2, scales = quantize_experts(w13, w2, (128, 128))
            shared = quantize_experts(*shared, (128, 128))
        want = fused_experts_reference(x, w13, w2, None, slot_of, weight_of, shared=shared, scales=scales,
                                       act_fp8=args.act_fp8)
        built_in = pick_config(slot_of.numel(), w13.shape[0], w13.dtype, args.act_fp8)
        if args.fp8:
            us = graph_ms(lambda: fused_experts_triton(x, bf16[0], bf16[1], None, slot_of, weight_of, built_bf16,
                                                       shared=bf16[2]), 3, args.iters) * 1e3
            rows.append(dict(model=args.model, tokens=tokens, sweep="bf16 built-in", us=round(us, 2)))
            print(json.dumps(rows[-1]), flush=True)
        if args.act_fp8:
            built_a16 = pick_config(slot_of.numel(), w13.shape[0], w13.dtype)
            us = graph_ms(lambda: fused_experts_triton(x, w13, w2, None, slot_of, weight_of, built_a16, shared=shared,
                                                       scales=scales), 3, args.iters) * 1e3
            rows.append(dict(model=args.model, tokens=tokens, sweep="fp8 weights, 16-bit activations built-in",
                             us=round(us, 2)))
            print(json.dumps(rows[-1]), flush=True)

        def timed(cfg, label):
            try:
                return _timed(cfg, label)
            except Exception as e:  # a shape past the shared memory (Triton's OutOfResources)
                print(json.dumps(dict(tokens=tokens, sweep=label, config=cfg._asdict(), error=type(e).__name__)))
                return float("inf")

        def _timed(cfg, label):
            def call():
                return fused_experts_triton(x, w13, w2, None, slot_of, weight_of, cfg, shared=shared, scales=scales,
                                            act_fp8=args.act_fp8)

            err = relative_error(call(), want)
            # FP8 activations: a SwiGLU output rounded the other way can move its group's scale
            if err > (5e-2 if args.act_fp8 else 2e-2):
                raise AssertionError(f"wrong result ({err:.3g}) with {cfg}")
            us = graph_ms(call, 3, args.iters) * 1e3
            rows.append(dict(model=args.model, act_fp8=args.act_fp8, tokens=tokens, sweep=label, block_m=cfg.block_m,
                             gate_up=cfg.gate_up, down=cfg.down, pair_rows=cfg.pair_rows, us=round(us, 2),
                             err=round(err, 5)))
            print(json.dumps(rows[-1]), flush=True)
            return us

        base = timed(built_in, "built-in")
        if args.pair_rows_ab:
            timed(built_in._replace(pair_rows=not built_in.pair_rows), f"built-in, pair rows {not built_in.pair_rows}")
        if args.kernels:
            rows.append(dict(model=args.model, act_fp8=args.act_fp8, tokens=tokens, sweep="built-in kernels",
                             us_by_kernel=kernel_split(lambda: fused_experts_triton(
                                 x, w13, w2, None, slot_of, weight_of, built_in, shared=shared, scales=scales,
                                 act_fp8=args.act_fp8)), mma=mma_forms()))
            print(json.dumps(rows[-1]), flush=True)
        if args.built_in_only:
            continue
        if best is None or args.prefill:  # decode: sweep at the first token count, check the winner at the others
            winners = []
            for block_m in args.block_m or [built_in.block_m]:
                start = built_in._replace(block_m=block_m)
                candidates = []
                for (n, k, warps), stages in itertools.product(shapes, args.stages):
                    cfg = start._replace(gate_up=(n, k, warps, stages))
                    candidates.append((timed(cfg, "gate_up"), cfg))
                gate_up = min(candidates, key=lambda c: c[0])[1].gate_up
                candidates = []
                for (n, k, warps), stages in itertools.product(shapes, args.stages):
                    cfg = start._replace(gate_up=gate_up, down=(n, k, warps, stages))
                    candidates.append((timed(cfg, "down"), cfg))
                winners.append(min(candidates, key=lambda c: c[0]))
            best = min(winners, key=lambda c: c[0])[1]
        us = timed(best if args.block_m else best._replace(block_m=built_in.block_m), "best")
        print(json.dumps(dict(tokens=tokens, built_in_us=round(base, 2), best_us=round(us, 2),
                              best=best._asdict())), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def kernel_split(call, iters: int = 10) -> dict[str, float]:
    """GPU us a call of each kernel `call` launches (eager, so the profiler sees each launch)."""
    from torch.profiler import ProfilerActivity, profile
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    us = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if total > 0 and not e.key.startswith(("cuda", "Memcpy", "Memset")):
            us[e.key] = round(total / iters, 2)
    return dict(sorted(us.items(), key=lambda kv: -kv[1]))


def mma_forms() -> dict[str, dict[str, int]]:
    """For each build of the two expert kernels: how many wgmma and mma.sync instructions its PTX has."""
    import wideep_kernels.moe_gemm as mg
    forms = {}
    for fn in (mg._gate_up_kernel, mg._down_kernel):
        plain = ("num_tiles", "num_tokens", "zero_count") + (("num_pairs",) if fn is mg._down_kernel else ())
        jitted = mg._jit(fn, *plain)
        for cache in getattr(jitted, "device_caches", {}).values():
            for i, build in enumerate(cache[0].values()):
                ptx = build.asm.get("ptx", "")
                forms[f"{fn.__name__}#{i}"] = dict(wgmma=ptx.count("wgmma.mma_async"), mma_sync=ptx.count("mma.sync"))
    return forms


def gate_parts_times(token_counts: list[int], iters: int) -> list[dict]:
    from wideep_kernels.routing import gate_parts_triton
    rows = []
    w = torch.randn(BENCH_MODEL["slots"], BENCH_MODEL["hidden"], device="cuda")
    for tokens in token_counts:
        x = torch.randn(tokens, BENCH_MODEL["hidden"], device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.T
        for parts, block_t, block_e, warps in itertools.product((8, 16, 32), (16, 32, 64), (16, 32, 64), (2, 4)):
            if block_t > max(16, tokens):
                continue
            kw = dict(block_t=block_t, block_e=block_e, num_warps=warps)
            got = gate_parts_triton(x, w, parts, **kw).sum(0)
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
            # 16 calls a replay: one small kernel alone would time the replay's own cost
            us = graph_ms(lambda: gate_parts_triton(x, w, parts, **kw), 3, iters, repeat=16) * 1e3
            rows.append(dict(kernel="gate_parts", tokens=tokens, parts=parts, **kw, us=round(us, 2)))
            print(json.dumps(rows[-1]), flush=True)
        best = min((r for r in rows if r["tokens"] == tokens), key=lambda r: r["us"])
        print(json.dumps(dict(best=True, **best)), flush=True)
    return rows


if __name__ == "__main__":
    main()
