"""Time to a first token of fresh 2048-token prompts (prompt chunks of 2048), bench model on one GPU:
bf16 experts, then FP8 experts with 16-bit, 'auto' (FP8 in chunks) and FP8 activations."""
import json
import sys
import time

import torch

from bench.engine_vs_hf import build_ours
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
name = "bench" if device == "cuda" else "tiny"
tokens = 2048 if device == "cuda" else 64
iters = 8 if device == "cuda" else 2
cfg = preset(name)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = build_ours(cfg, device, dtype)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
gen = torch.Generator().manual_seed(0)
for experts, activations in (("model", "model"), ("fp8_e4m3", "model"), ("fp8_e4m3", "auto"),
                             ("fp8_e4m3", "fp8_e4m3")):
    ecfg = EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), block_size=64, num_blocks=512,
                        max_num_seqs=4, max_num_batched_tokens=tokens, max_model_len=tokens + 8, warmup=False,
                        expert_dtype=experts, expert_activations=activations, enable_prefix_caching=False)
    engine = LLMEngine(model, None, ecfg)
    times = []
    for i in range(iters + 2):
        prompt = torch.randint(10, cfg.vocab_size, (tokens,), generator=gen).tolist()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.generate([prompt], params)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
        assert len(out[0].output_token_ids) == 1
    assert engine.scheduler.blocks.num_used_blocks == 0
    layer = engine.runner.model.moe_layers()[0]
    times.sort()
    print(json.dumps(dict(experts=experts, activations=activations, resolved=layer.activations,
                          weights=str(layer.w13.dtype), tokens=tokens, median_ms=round(times[len(times) // 2], 2),
                          min_ms=round(times[0], 2))), flush=True)
