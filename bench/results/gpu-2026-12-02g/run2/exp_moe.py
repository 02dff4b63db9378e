"""Run 2 probe: per-kernel split and accumulation error of the FP8 expert kernels at prompt-chunk sizes."""
import json
import sys

import torch

import kernels.moe_gemm as mg
from bench.kernel_moe_gemm import BENCH_MODEL, DEEPSEEK_V3, make_inputs, relative_error
from bench.probe_moe import kernel_split
from kernels.fp8_blocks import quantize_experts

timing_only = "--timing-only" in sys.argv
for model_name, model, tokens in (("bench", BENCH_MODEL, 2048), ("bench", BENCH_MODEL, 512), ("dsv3", DEEPSEEK_V3, 512)):
    x, w13, w2, _, slot_of, weight_of = make_inputs(dict(model, tokens=tokens), "cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    shared = ((torch.randn(w13.shape[1:], generator=g) * model["hidden"] ** -0.5).to(w13),
              (torch.randn(w2.shape[1:], generator=g) * model["inter"] ** -0.5).to(w2))
    q13, q2, scales = quantize_experts(w13, w2, (128, 128))
    qshared = quantize_experts(*shared, (128, 128))
    variants = {"bf16": lambda: mg.fused_experts_triton(x, w13, w2, None, slot_of, weight_of, shared=shared),
                "fp8 weights": lambda: mg.fused_experts_triton(x, q13, q2, None, slot_of, weight_of, shared=qshared,
                                                               scales=scales)}
    for name, call in variants.items():
        print(json.dumps(dict(model=model_name, tokens=tokens, variant=name, us=kernel_split(call))), flush=True)
    xf = x.float()
    want32 = None if timing_only else mg.fused_experts_reference(xf, q13, q2, None, slot_of, weight_of, shared=qshared,
                                                                  scales=scales, act_fp8=True)
    want16 = None if timing_only else mg.fused_experts_reference(x, q13, q2, None, slot_of, weight_of, shared=qshared,
                                                                  scales=scales, act_fp8=True)
    for acc in (32, 64, 0):
        mg.FP8_PRECISE_ACC = acc
        call = lambda: mg.fused_experts_triton(x, q13, q2, None, slot_of, weight_of, shared=qshared, scales=scales,
                                               act_fp8=True)
        row = dict(model=model_name, tokens=tokens, variant=f"w8a8 acc {acc}", us=kernel_split(call))
        if not timing_only:
            row["err_bf16_x"] = round(relative_error(call(), want16), 6)
            row["err_fp32_x"] = round(relative_error(mg.fused_experts_triton(
                xf, q13, q2, None, slot_of, weight_of, shared=qshared, scales=scales, act_fp8=True), want32), 6)
        print(json.dumps(row), flush=True)
    mg.FP8_PRECISE_ACC = 32
