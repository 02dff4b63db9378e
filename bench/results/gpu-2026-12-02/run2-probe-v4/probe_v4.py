import sys, time, torch
from bench.engine_vs_hf import build_ours, V3_OFF
from engine.config import preset, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from torch.profiler import ProfilerActivity, profile
out = sys.argv[1]
for label, cfg in (("v4", preset("bench")), ("v3", preset("bench", **V3_OFF))):
    model = build_ours(cfg, "cuda", torch.bfloat16)
    for batch in (64,):
        ecfg = EngineConfig(device="cuda", dtype="bfloat16", block_size=16, num_blocks=batch * 7 + 8, max_num_seqs=batch,
                            max_num_batched_tokens=batch * 32, enable_prefix_caching=False)
        e = LLMEngine(model, None, ecfg)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(4, cfg.vocab_size, (32,), generator=g).tolist() for _ in range(batch)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for _ in range(3):
            e.generate(prompts, one)
        print(label, batch, "graphs", sorted(k for k in e.runner.graphs.graphs if k[0] == "chunk"), "failed", e.runner.graphs.failed)
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); t = time.perf_counter(); e.generate(prompts, one); torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        key = max((k for k in e.runner.graphs.graphs if k[0] == "chunk"), default=None)
        rep = None
        if key:
            gr = e.runner.graphs.graphs[key][0]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gr.replay(); torch.cuda.synchronize(); a.record()
            for _ in range(10):
                gr.replay()
            b.record(); torch.cuda.synchronize(); rep = a.elapsed_time(b) / 10
        print(label, batch, "generate(1 token) ms", [round(t, 2) for t in ts], "replay of", key, "ms", rep, flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            e.generate(prompts, one); torch.cuda.synchronize()
        with open(f"{out}/prof_{label}_{batch}.txt", "w") as f:
            t = prof.key_averages()
            f.write(t.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
            f.write(t.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        del e
