"""Decode graphs of short contexts: what one shared table width costs a step, and what the
captures met while serving cost the requests (EngineConfig.cuda_graph_min_tokens).

    python3 -m bench.graph_widths --preset bench --batches 1 16 64        # one GPU
    .venv/bin/python -m bench.graph_widths --preset tiny --device cpu --batches 2 --contexts 40 --steps 30 \
        --turn-prompt 40 --turn-steps 8 --turn-new 8  # smoke

Two parts, each side by side in one run:
- `cost`: on one engine, the decode forward (the graph's replay, CUDA events, median) of a batch
  at each context, its block table padded to the four-per-octave width of its context
  (`bucket_ms`, cuda_graph_min_tokens=0) and to the shared short-context width (`shared_ms`, the
  default). Sequences are made up (bench/forward.py).
- `serve`: per mode (`per_width`: cuda_graph_min_tokens=0; `per_width_eager`: the same, each
  capture preceded by an eager run of its step, not only the first of its rows; `per_width_collect`:
  that, and each capture preceded by a garbage collection and the allocator's caches emptied, as
  torch.cuda.graph does; `per_width_own_logits`: each graph's logits in a buffer of its own;
  `shared`: the default), a fresh engine warmed up as at start, then
  `batch` requests decoding from a `--prompt`-token prompt for `--steps` steps (contexts
  crossing many table widths): the warm-up's seconds, graphs and seconds in captures, the graphs
  captured while decoding and the milliseconds each took, and the steps' wall time (median, max,
  and the seconds the steps over 3x the median took beyond it, which is what the requests
  waited for captures), and the device memory the engine held after its warm-up and what serving
  added to it.
- `turns`: `batch` conversations of two turns past the shared width (`--turn-prompt` tokens, then
  `--turn-steps` decode steps; the second turn adds `--turn-new` tokens and decodes as many
  steps), with and without capturing ahead between the turns (EngineConfig.cuda_graph_ahead_idle_s):
  per turn, the graphs captured while requests waited and the seconds they stalled them (the
  engine's own figures, LLMEngine.stats), the turn's wall time, and the graphs captured while idle
  between the turns and the seconds that took.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench.ep_decode import build
from bench.forward import make_batch, time_forward
from engine.config import EngineConfig, preset
from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

# mode -> cuda_graph_min_tokens, and what each capture does as the engine's did before:
# eager_each: an eager run of its step first, not only for the first of its form, rows and sparse
# flag (until 2026-12-04); collect: a garbage collection and the allocator's caches emptied first,
# as torch.cuda.graph does (until 2026-12-03); own_logits: its logits in a buffer of its own, kept
# with it (until 2026-12-04), not the graphs' shared one.
MODES = {"per_width": dict(min_tokens=0), "per_width_eager": dict(min_tokens=0, eager_each=True),
         "per_width_collect": dict(min_tokens=0, eager_each=True, collect=True),
         "per_width_own_logits": dict(min_tokens=0, own_logits=True), "shared": dict(min_tokens=None)}


class CaptureClock:
    """Seconds spent in DecodeGraphs._capture, and the mode's older capture behaviour (set_mode),
    patched into DecodeGraphs for the bench's engines while in use."""

    def __enter__(self):
        self.seconds, self.count, self.collect, self.eager_each, self.own_logits = 0.0, 0, False, False, False
        capture, before, shared = self.saved = DecodeGraphs._capture, DecodeGraphs._before_capture, DecodeGraphs._logits
        clock = self

        def logits(graphs, rows):
            if not clock.own_logits:
                return shared(graphs, rows)
            return torch.empty(rows, graphs.runner.model.cfg.vocab_size, dtype=torch.float32,
                               device=graphs.runner.device)

        def timed(graphs, *args, eager_first=True):
            t = time.perf_counter()
            try:
                return capture(graphs, *args, eager_first=eager_first or clock.eager_each)
            finally:
                clock.seconds += time.perf_counter() - t
                clock.count += 1

        def prelude(graphs):
            before(graphs)
            if clock.collect:
                gc.collect()
                torch.cuda.empty_cache()
                torch._C._host_emptyCache()
        DecodeGraphs._capture, DecodeGraphs._before_capture, DecodeGraphs._logits = timed, prelude, logits
        return self

    def __exit__(self, *exc):
        DecodeGraphs._capture, DecodeGraphs._before_capture, DecodeGraphs._logits = self.saved

    def set_mode(self, mode: str) -> int | None:
        """Take a mode's capture behaviour; returns its cuda_graph_min_tokens."""
        m = MODES[mode]
        self.collect, self.eager_each, self.own_logits = (m.get(k, False)
                                                          for k in ("collect", "eager_each", "own_logits"))
        return m["min_tokens"]

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.count)
        self.seconds, self.count = 0.0, 0
        return out


def engine_config(args, batch: int, min_tokens: int | None, warmup: bool) -> EngineConfig:
    cuda = args.device == "cuda"
    longest = max(args.prompt + args.steps + 16, max(args.contexts) + 2)
    return EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16,
                        max_num_seqs=batch, num_blocks=batch * (longest // 16 + 2) + 16, warmup=warmup,
                        max_num_batched_tokens=max(512, args.prompt), cuda_graph_min_tokens=min_tokens)


def cost(model, args) -> list[dict]:
    rows = []
    engine = LLMEngine(model, None, engine_config(args, max(args.batches), None, warmup=False))
    g = engine.runner.graphs
    shared = g.min_blocks if g is not None else None
    for batch in args.batches:
        for context in args.contexts:
            b = make_batch(engine, batch, context)
            times = {}
            for name, floor in (("bucket_ms", 16), ("shared_ms", shared)):
                if g is not None:
                    g.min_blocks = floor
                times[name] = round(time_forward(engine, b, args.iters)[0], 4)
            row = {"part": "cost", "batch": batch, "context": context, **times,
                   "ratio": round(times["shared_ms"] / times["bucket_ms"], 3),
                   "shared_tokens": shared * 16 if shared else None}
            rows.append(row)
            print(json.dumps(row), flush=True)
    del engine, g
    _release(args.device == "cuda")
    return rows


def serve(model, args, batch: int, mode: str, clock: CaptureClock) -> dict:
    cuda = args.device == "cuda"
    min_tokens = clock.set_mode(mode)
    clock.take()
    mem0 = _allocated(cuda)
    t0 = time.perf_counter()
    engine = LLMEngine(model, None, engine_config(args, batch, min_tokens, warmup=cuda))
    warmup_s = time.perf_counter() - t0
    mem_start = _allocated(cuda)
    start_capture_s, _ = clock.take()
    g = engine.runner.graphs
    graphs0 = len(g.graphs) if g is not None else 0
    gen = torch.Generator().manual_seed(batch)
    vocab = model.cfg.vocab_size
    for i in range(batch):
        engine.add_request(f"{mode}-{i}", torch.randint(4, vocab, (args.prompt,), generator=gen).tolist(),
                           SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        steps.append(1000 * (time.perf_counter() - t))
    serving_capture_s, serving_captures = clock.take()
    mem_end = _allocated(cuda)
    decode = steps[2:-2]  # the prefill and the tail of the last step ahead left out
    median = statistics.median(decode)
    slow = [s for s in decode if s > 3 * median]
    row = {"part": "serve", "mode": mode, "batch": batch, "warmup_s": round(warmup_s, 2),
           "graphs_at_start": graphs0, "start_capture_s": round(start_capture_s, 2),
           "captured_serving": (len(g.graphs) if g is not None else 0) - graphs0,
           "capture_ms_each": round(1000 * serving_capture_s / serving_captures, 1) if serving_captures else None,
           "steps": len(decode), "median_ms": round(median, 3), "max_ms": round(max(decode), 2),
           "slow_steps": len(slow), "stalled_s": round(sum(s - median for s in slow) / 1000, 3),
           "total_s": round(sum(decode) / 1000, 3),
           # memory the engine holds after its warm-up (KV pool and graphs), and what serving added
           "engine_mb": round((mem_start - mem0) / 2**20), "serving_added_mb": round((mem_end - mem_start) / 2**20)}
    print(json.dumps(row), flush=True)
    del engine, g
    _release(cuda)
    return row


def turns(model, args, batch: int, ahead: bool) -> list[dict]:
    cuda = args.device == "cuda"
    longest = args.turn_prompt + 2 * args.turn_steps + args.turn_new + 16
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16,
                       max_num_seqs=batch, num_blocks=batch * (longest // 16 + 2) + 16, warmup=cuda,
                       max_num_batched_tokens=max(512, args.turn_new),
                       cuda_graph_ahead_idle_s=0.0 if ahead else None)
    engine = LLMEngine(model, None, cfg)
    gen, vocab = torch.Generator().manual_seed(batch), model.cfg.vocab_size
    params = SamplingParams(max_tokens=args.turn_steps, temperature=0, ignore_eos=True)
    prompts = [torch.randint(4, vocab, (args.turn_prompt,), generator=gen).tolist() for _ in range(batch)]
    rows, idle = [], {"idle_captures": 0, "idle_s": 0.0}
    for turn in (1, 2):
        before, t = engine.stats(), time.perf_counter()
        outs = engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        wall, after = time.perf_counter() - t, engine.stats()
        row = {"part": "turns", "mode": "ahead" if ahead else "no_ahead", "batch": batch, "turn": turn,
               "context": len(prompts[0]) + args.turn_steps, "turn_s": round(wall, 3),
               "captures": after.get("graph_captures", 0) - before.get("graph_captures", 0),
               "capture_s": round(after.get("graph_capture_s", 0.0) - before.get("graph_capture_s", 0.0), 3),
               **(idle if turn == 2 else {})}
        rows.append(row)
        print(json.dumps(row), flush=True)
        prompts = [p + o.output_token_ids + torch.randint(4, vocab, (args.turn_new,), generator=gen).tolist()
                   for p, o in zip(prompts, outs)]
        t = time.perf_counter()
        while turn == 1 and engine.housekeeping() is not None:  # what an idle engine loop would do
            idle["idle_captures"] += 1
        idle["idle_s"] = round(time.perf_counter() - t, 3)
    del engine
    _release(cuda)
    return rows


def _allocated(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else 0


def _release(cuda: bool) -> None:
    gc.collect()  # an engine's KV pool and graphs, before the next engine allocates its own
    if cuda:
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 600, 1200, 2100],
                    help="contexts of the cost part (below the shared width)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=1900, help="decode steps of the serve part")
    ap.add_argument("--parts", nargs="+", default=["cost", "serve", "turns"], choices=["cost", "serve", "turns"])
    ap.add_argument("--turn-prompt", type=int, default=2900, help="first turn's prompt tokens (turns part)")
    ap.add_argument("--turn-steps", type=int, default=100, help="decode steps of each turn (turns part)")
    ap.add_argument("--turn-new", type=int, default=200, help="tokens the second turn adds (turns part)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="modes of the serve part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    model = build(preset(args.preset), args.device, torch.bfloat16 if cuda else torch.float32)
    # (a garbage collection's cost grows with them: a Serve replica, with Ray and transformers
    # loaded, holds more than this process)
    report = {"preset": args.preset, "device": args.device, "python_objects": len(gc.get_objects()), "rows": []}
    with torch.inference_mode():
        if "cost" in args.parts:
            report["rows"] += cost(model, args)
    if "serve" in args.parts:
        with CaptureClock() as clock:
            for batch in args.batches:
                for mode in args.modes:
                    report["rows"].append(serve(model, args, batch, mode, clock))
    if "turns" in args.parts:
        for batch in args.batches:
            for ahead in (False, True):
                report["rows"] += turns(model, args, batch, ahead)
    print(json.dumps(report), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
