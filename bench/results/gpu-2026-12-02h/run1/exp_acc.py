"""How often the FP8 tensor cores' sums go into fp32 (FP8_PRECISE_ACC) against the error of the
FP8-activation kernels: the unit tests' fp32 chunk-tile case and the bench layer in fp32."""
import json
import sys

import torch

sys.path.insert(0, "tests")
import kernels.moe_gemm as mg  # noqa: E402
from bench.kernel_moe_gemm import BENCH_MODEL, DEEPSEEK_V3, make_inputs, relative_error  # noqa: E402
from kernels.fp8_blocks import quantize_experts  # noqa: E402
from test_kernel_moe_fp8 import block_varied_weights, routing, to  # noqa: E402
from test_kernel_moe_w8a8 import group_varied_rows, rel_err  # noqa: E402


def chunk_case(block_m, pair_rows):
    hidden, inter, num_slots, topk, num_tokens = 256, 128, 2, 2, 40
    q13, q2, scales = to("cuda", *quantize_experts(*block_varied_weights(num_slots, hidden, inter, (32, 32)), (128, 256)))
    x = group_varied_rows(num_tokens, hidden, 128, seed=4).to("cuda", torch.float32)
    slot_of, weight_of = routing(num_tokens, topk, num_slots, "cuda")
    config = mg.MoEGemmConfig(block_m, (32, 64, 4, 2), (32, 32, 4, 2), pair_rows)
    got = mg.fused_experts_triton(x, q13, q2, None, slot_of, weight_of, config=config, scales=scales, act_fp8=True)
    want = mg.fused_experts_reference(x, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    return rel_err(got, want)


layers = {}
for name, model, tokens in (("bench", BENCH_MODEL, 512), ("bench", BENCH_MODEL, 2048), ("dsv3", DEEPSEEK_V3, 512)):
    x, w13, w2, _, slot_of, weight_of = make_inputs(dict(model, tokens=tokens), "cuda", torch.bfloat16)
    q13, q2, scales = quantize_experts(w13, w2, (128, 128))
    del w13, w2
    xf = x.float()
    want = mg.fused_experts_reference(xf, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
    layers[(name, tokens)] = (xf, q13, q2, scales, slot_of, weight_of, want)

for acc in (32, 64, 128, 0):
    mg.FP8_PRECISE_ACC = acc
    row = dict(acc=acc)
    for block_m in (16, 64):
        for pair_rows in (False, True):
            row[f"chunk m{block_m}{' pairs' if pair_rows else ''}"] = round(chunk_case(block_m, pair_rows), 7)
    for (name, tokens), (xf, q13, q2, scales, slot_of, weight_of, want) in layers.items():
        got = mg.fused_experts_triton(xf, q13, q2, None, slot_of, weight_of, scales=scales, act_fp8=True)
        row[f"{name} {tokens} norm"] = round(rel_err(got, want), 7)
        row[f"{name} {tokens} max"] = round(relative_error(got, want), 6)
    print(json.dumps(row), flush=True)
