"""Decode forward benchmark: step time across context lengths, against the HBM roofline.

    python -m bench.forward --device cuda --batch 16 --contexts 8192 65536 131072 262144 524288
    python -m bench.forward --device cuda --batch 64 --contexts 8192 --moe-share --graphs-vs-eager
    python -m bench.forward --device cpu --preset tiny --batch 2 --contexts 64 256 --iters 3   # smoke

Sequences are made up, not prefilled: each of `batch` sequences gets `context` positions of
random global KV (and a full window ring), then the same decode step is replayed. Columns:
- forward_ms: the decode forward on the device (the CUDA graph's replay alone, or the eager
  forward), CUDA events, median; step_ms: the engine's whole `runner.run` (host-side inputs
  built from the block tables included), wall clock;
- roofline_ms: bytes the step must read (weights it touches + KV it reads) / copy bandwidth
  measured in the same run (a device-to-device copy reads and writes: 2 x bytes / time);
  roofline_pct = roofline_ms / forward_ms;
- pdl: the kernels' programmatic dependent launch mode (wideep_kernels/pdl.py, WIDEEP_PDL; 0 = off);
- moe_share (--moe-share): 1 - forward time with every MoE layer replaced by a no-op / full.
`--index-topk-freq 1 4 16` adds rows with the indexer scoring in every n-th layer only
(EngineConfig.index_topk_freq); their roofline counts only the index keys those layers read.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from bench.engine_vs_hf import build_ours
from bench.kernel_timing import write_kernel_table
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine import moe as moe_module
from engine.moe import MoE
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence, Status
from wideep_kernels import pdl, tuning


EXPERT_ACTIVATIONS = {"fp8_w8a8": "fp8_e4m3", "fp8_w8a16": "model"}  # --expert-dtype -> expert_activations


def copy_bandwidth(device, nbytes=2 << 30, rounds: int = 3) -> float:
    """Bytes/s of HBM traffic in a device-to-device copy (read + write): the best of `rounds`
    medians of 8 copies. One round came out 3% low in a run of the ninth session (4,122 against
    4,235-4,250 GB/s elsewhere), which alone moved the step's % of roofline from 58 to 60."""
    if torch.device(device).type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(rounds):
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        best = max(best, 2 * nbytes / statistics.median(times[2:]))
    del src, dst
    return best


def make_batch(engine: LLMEngine, batch: int, context: int, seed: int = 0) -> ScheduledBatch:
    """`batch` running sequences at `context` positions each, their KV filled with random values."""
    r, bs = engine.runner, engine.cfg.block_size
    g = torch.Generator().manual_seed(seed)
    seqs = []
    blocks_each = -(-(context + 1) // bs)
    for i in range(batch):
        seq = Sequence(f"bench-{i}", torch.randint(4, 1000, (context,), generator=g).tolist(),
                       SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True))
        seq.output_ids.append(5)
        seq.block_table = list(range(i * blocks_each, (i + 1) * blocks_each))
        seq.num_computed_tokens = seq.num_cached_tokens = context
        seq.status = Status.RUNNING
        if r.kv.window:
            seq.window_slot = i
        seqs.append(seq)
    kv = r.kv
    gen = torch.Generator(device=r.device).manual_seed(seed)
    for t in (kv.global_kv, kv.index_keys):
        if t is not None:
            for src in range(t.shape[0]):  # one source at a time: randn of the whole pool doubles memory
                t[src].copy_(torch.randn(t.shape[1:], generator=gen, device=r.device, dtype=torch.float32))
    if kv.window:
        w = kv.window
        kv.window_kv.normal_(generator=gen)
        for i in range(batch):  # ring slot p % W holds position p, for the last W positions
            pos = torch.arange(context - w, context, device=r.device)
            kv.window_pos[i, pos % w] = pos
    return ScheduledBatch(seqs=seqs, num_tokens=[1] * batch)


@torch.inference_mode()
def time_forward(engine: LLMEngine, batch: ScheduledBatch, iters: int) -> tuple[float, float]:
    """(forward_ms, step_ms) medians. Replaying the same step is idempotent: it rewrites the
    same KV entries and window slots."""
    r = engine.runner
    cuda = r.device.type == "cuda"
    for _ in range(3):
        r.run(batch)
    fwd, step = [], []
    for _ in range(iters):
        inputs = r.decode_inputs(batch) if r.graphs is None else None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if r.graphs is not None:
            r.graphs.last.replay()
        else:
            r.decode_forward(*inputs)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            fwd.append(start.elapsed_time(end))
        else:
            fwd.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        r.run(batch)
        if cuda:
            torch.cuda.synchronize()
        step.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(fwd), statistics.median(step)


@torch.inference_mode()
def step_parts(engine: LLMEngine, batch: ScheduledBatch, iters: int) -> dict:
    """Where `step_ms - forward_ms` goes on the CUDA-graph path, medians in microseconds, the GPU
    idle at the start of each: `checks_us` (is it a decode step, rope tables long enough),
    `graph_run_us` (the graph path: inputs into pinned memory, one copy, replay, to the end of
    the replay) and `graph_run_host_us` (the same until the host is free), `five_copies_us` (as
    the path was: index tensors built as a device buffer from pageable memory, copied into five
    static tensors, then the replay), `replay_us` (the replay alone), `sample_us` (greedy)."""
    r = engine.runner
    g = r.graphs
    if g is None or r.device.type != "cuda":
        return {}
    b = len(batch)
    pad_b = next(s for s in g.sizes if s >= b)
    pad_m = g._blocks_bucket(r.decode_width(batch))
    static = r.decode_input_views(torch.empty(r.decode_input_bytes(pad_b, pad_m)[1], dtype=torch.uint8,
                                              device=r.device), pad_b, pad_m)
    parts: dict[str, list[float]] = {}

    def lap(name, t0):
        torch.cuda.synchronize()
        parts.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        return time.perf_counter()

    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r.model.model.rotary.ensure(r.decode_length(batch))
        t = lap("checks_us", t)
        g.run(batch)
        parts.setdefault("graph_run_host_us", []).append((time.perf_counter() - t) * 1e6)
        t = lap("graph_run_us", t)
        inputs = r.decode_inputs(batch, pad_batch=pad_b, pad_blocks=pad_m)
        for dst, src in zip(static, inputs[:-1]):
            dst.copy_(src, non_blocking=True)
        g.last.replay()
        t = lap("five_copies_us", t)
        g.last.replay()
        t = lap("replay_us", t)
        logits = r.run(batch)[1]
        torch.cuda.synchronize()
        t = time.perf_counter()
        r.sample(batch.seqs, logits)
        lap("sample_us", t)
    return {k: round(statistics.median(v[2:]), 1) for k, v in parts.items()}


def step_bytes(engine: LLMEngine, batch: int, context: int, experts_touched: list[int]) -> int:
    """Bytes one decode step must read: weights (routed experts only where touched; one embedding
    row per sequence) and the KV its attention and indexer read. Layers that reuse another's
    top-k (EngineConfig.index_topk_freq) read neither index keys nor their indexer's queries."""
    model, mc = engine.runner.model, engine.runner.model.cfg
    scoring = [layer.self_attn.scores for layer in model.model.layers]
    unread = {f"model.layers.{i}.self_attn.indexer.{w}.weight" for i, s in enumerate(scoring) if not s
              for w in ("wq", "weights_proj")}
    total = 0
    for name, p in model.named_parameters():
        if name in unread:
            continue
        if name.endswith("embed_tokens.weight"):
            total += batch * p.shape[1] * p.element_size()
        elif name.endswith("mlp.w13") or name.endswith("mlp.w2"):
            continue
        else:
            total += p.numel() * p.element_size()
    for moe, touched in zip(model.moe_layers(), experts_touched):
        total += touched * sum(t[0].numel() * t.element_size() for t in moe.slot_tensors())  # FP8: scales too
        shared_fp8 = moe._shared_fp8._value if moe.fp8_block is not None else None
        if shared_fp8 is not None:  # the fused slot read the shared expert's FP8 copy, not its 16-bit weights
            total -= sum(p.numel() * p.element_size() for p in moe.shared_experts.parameters())
            total += sum(t.numel() * t.element_size() for t in (*shared_fp8[:2], *shared_fp8[2][:2]))
    kv = engine.runner.kv
    d, kv_bytes = mc.latent_dim, kv.global_kv.element_size() + (4 / mc.latent_dim if kv.kv_scale is not None else 0)
    w = mc.sliding_window or 0
    g_len = max(0, context + 1 - (w - 1 if w else 0))
    attended = min(g_len, mc.index_topk) if mc.index_topk else g_len
    per_layer = attended * d * kv_bytes
    if w:
        per_layer += (w + 1) * d * kv.window_kv.element_size()
    total += batch * mc.num_hidden_layers * per_layer
    if mc.index_topk and g_len > mc.index_topk:
        per_key = mc.index_head_dim * kv.index_keys.element_size() + (4 if kv.index_scale is not None else 0)
        total += batch * sum(scoring) * g_len * per_key
    return int(total)


def experts_touched(engine: LLMEngine, batch: ScheduledBatch) -> list[int]:
    moes = engine.runner.model.moe_layers()
    for m in moes:
        m.take_load()
    engine.runner.run(batch)
    return [int((m.take_load() > 0).sum()) for m in moes]


class _NoMoE(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def without_moe(engine: LLMEngine):
    """Swap every MoE layer for a no-op (for the MoE-share ablation); returns the undo."""
    layers = [layer for layer in engine.runner.model.model.layers if isinstance(layer.mlp, MoE)]
    saved = [layer.mlp for layer in layers]
    for layer in layers:
        layer.mlp = _NoMoE()

    def undo():
        for layer, m in zip(layers, saved):
            layer.mlp = m
    return undo


def unfused_small():
    """The decode layer's small steps as they ran before their fused kernels, for a time side by
    side: silu then a multiply (torch), the latent's norm, rope and concatenation as three
    launches, the query's norm and a source layer's cache writes as launches of their own, the
    routed experts' pair tokens built as arange // k, their fp32 sum cast (and added to the shared
    experts' output where that is separate) in launches of their own. Returns the undo."""
    from engine import layers as layers_module
    from engine import model as model_module
    from wideep_kernels.rmsnorm import rms_norm
    from wideep_kernels.rope import apply_rope
    from wideep_kernels.swiglu import silu_mul_reference

    def latent(kv, weight, eps, cos, sin, interleave):
        c = weight.shape[0]
        return torch.cat([rms_norm(kv[:, :c], weight, eps), apply_rope(kv[:, c:], cos, sin, interleave)], dim=-1)

    def latent_and_query(kv, weight, eps, cos, sin, interleave, q, q_weight, q_eps, write=None):
        out = latent(kv, weight, eps, cos, sin, interleave)
        if write is not None:
            slots, slab, key, key_slab = write
            slab[slots] = out
            key_slab[slots] = key.to(key_slab.dtype)
        return out, rms_norm(q, q_weight, q_eps)

    def experts(self, x, slots, weights, add=None, shared=None, fp32_out=False):
        t, k = slots.shape
        token_of = torch.div(torch.arange(t * k, device=x.device), k, rounding_mode="floor")
        out = self.expert_pairs(x, token_of, slots.flatten(), weights.flatten(), count=False, shared=shared)
        return out if add is None else out + (add() if callable(add) else add)

    swaps = [(layers_module, "silu_mul", silu_mul_reference), (moe_module, "silu_mul", silu_mul_reference),
             (model_module, "norm_rope_latent", latent), (model_module, "latent_and_query", latent_and_query),
             (MoE, "experts", experts)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    for obj, name, new in swaps:
        setattr(obj, name, new)

    def undo():
        for obj, name, old in saved:
            setattr(obj, name, old)
    return undo


def unfused_gate():
    """The router's fp32 GEMM in place of the partial-logits kernel. Returns the undo."""
    fused_ok, moe_module.gate_fused_ok = moe_module.gate_fused_ok, lambda x: False

    def undo():
        moe_module.gate_fused_ok = fused_ok
    return undo


def mla_gluon(on: bool):
    """Force the Gluon MLA decode split kernel on or off where it applies. Returns a function
    that applies the change (time_changed's form), which returns the undo."""
    from wideep_kernels import mla_decode_gluon

    def change():
        saved, mla_decode_gluon.GLUON_OVERRIDE = mla_decode_gluon.GLUON_OVERRIDE, on

        def undo():
            mla_decode_gluon.GLUON_OVERRIDE = saved
        return undo
    return change


def mla_override(fields: dict):
    """The tuned MLA decode configuration with `fields` replaced (e.g. {"slots": true}), in
    time_changed's form: a table choice checked inside the whole step."""
    from wideep_kernels import mla_decode

    def change():
        real = mla_decode.tuned_config

        def patched(device, kernel, key):
            cfg = real(device, kernel, key)
            return dict(cfg, **fields) if cfg is not None and kernel == "mla_decode" else cfg
        mla_decode.tuned_config = patched

        def undo():
            mla_decode.tuned_config = real
        return undo
    return change


def gate_parts(parts: int):
    """The router's partial logits split into `parts` slices of the hidden size, in
    time_changed's form."""
    import functools

    from wideep_kernels.routing import gate_parts_triton

    def change():
        real = moe_module.gate_parts_triton
        moe_module.gate_parts_triton = functools.partial(gate_parts_triton, parts=parts)

        def undo():
            moe_module.gate_parts_triton = real
        return undo
    return change


def shared_fusion(engine: LLMEngine, on: bool):
    """The shared expert as one more slot of the fused MoE kernels (EngineConfig.fuse_shared_experts)
    or a separate MLP, in time_changed's form."""
    def change():
        for moe in engine.runner.model.moe_layers():
            moe.fuse_shared = on
        return lambda: [setattr(m, "fuse_shared", engine.cfg.fuse_shared_experts)
                        for m in engine.runner.model.moe_layers()]
    return change


def select_method(fused_max_width: int, programs: int | None = None):
    """The indexer's top-k selected in one launch for rows up to `fused_max_width` positions
    and by the radix passes, count and emit as separate launches above (torch.topk past 128K),
    in time_changed's form. `programs`: split rows over about this many programs in all
    (row_select.TARGET_PROGRAMS)."""
    from wideep_kernels import indexer, row_select

    def change():
        saved = indexer.FUSED_MAX_WIDTH, indexer.FUSED_MIN_ROWS, row_select.TARGET_PROGRAMS
        indexer.FUSED_MAX_WIDTH = fused_max_width
        indexer.FUSED_MIN_ROWS = 1  # every batch size, where the width allows it
        row_select.TARGET_PROGRAMS = programs or row_select.TARGET_PROGRAMS

        def undo():
            indexer.FUSED_MAX_WIDTH, indexer.FUSED_MIN_ROWS, row_select.TARGET_PROGRAMS = saved
        return undo
    return change


def overlap(engine: LLMEngine, on: bool):
    """Side-stream branches in the captured step (EngineConfig.decode_overlap) on or off, in
    time_changed's form."""
    def change():
        engine.runner.set_overlap(on)
        return lambda: engine.runner.set_overlap(engine.cfg.decode_overlap)
    return change


def time_changed(engine: LLMEngine, batch: ScheduledBatch, iters: int, change) -> float:
    """Forward ms with `change()` applied (graphs recaptured), then undone."""
    undo = change()
    try:
        if engine.runner.graphs is not None:
            engine.runner.graphs.clear()
        return time_forward(engine, batch, iters)[0]
    finally:
        undo()
        if engine.runner.graphs is not None:
            engine.runner.graphs.clear()


@torch.inference_mode()
def profile_step(engine: LLMEngine, batch: ScheduledBatch, path: str, title: str) -> int:
    """Profile one eager decode forward (graphs hide the kernels from the profiler): append
    the table of kernels by device time to `path`; returns how many kernels the step launched.
    Dependent launches (wideep_kernels/pdl.py) are off for it: each kernel's time would include its
    wait for the one before."""
    from torch.profiler import ProfilerActivity, profile
    r = engine.runner
    graphs, r.graphs = r.graphs, None
    mode, pdl.MODE = pdl.MODE, 0
    try:
        inputs = r.decode_inputs(batch)
        r.decode_forward(*inputs)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if r.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            r.decode_forward(*inputs)
            if r.device.type == "cuda":
                torch.cuda.synchronize()
    finally:
        r.graphs, pdl.MODE = graphs, mode
    return write_kernel_table(prof, path, title + ", dependent launches off")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 65536, 131072, 262144, 524288])
    ap.add_argument("--kv-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3"])
    ap.add_argument("--index-dtype", default=None, choices=["auto", "fp8_e4m3"],
                    help="EngineConfig.index_cache_dtype (default: follow --kv-dtype)")
    ap.add_argument("--index-topk-freq", type=int, nargs="+", default=[1],
                    help="EngineConfig.index_topk_freq: the indexer scores in every n-th layer, the others "
                         "reuse its top-k (one row each)")
    ap.add_argument("--moe-gemm", nargs="+", default=["auto"], choices=["auto", "triton", "grouped_mm"])
    ap.add_argument("--expert-dtype", nargs="+", default=["auto"], choices=["auto", "fp8_e4m3", "fp8_w8a8", "fp8_w8a16"],
                    help="routed experts' weights; quantizing is in place, so 'auto' runs first. fp8_e4m3: FP8 "
                         "weights, expert_activations 'auto'; fp8_w8a8 / fp8_w8a16: with FP8 / 16-bit activations "
                         "throughout")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--moe-share", action="store_true", help="also time the step with MoE layers removed")
    ap.add_argument("--graphs-vs-eager", action="store_true", help="also time the eager forward (no CUDA graphs)")
    ap.add_argument("--unfused-gate", action="store_true",
                    help="also time the step with the router's fp32 GEMM in place of the partial-logits kernel")
    ap.add_argument("--unfused-small", action="store_true",
                    help="also time the step with silu*mul, the latent's norm/rope/concatenation and the MoE "
                         "pair tokens as separate launches, as before their fused kernels")
    ap.add_argument("--mla-gluon", action="store_true",
                    help="also time the step with the Gluon MLA decode kernel forced on and forced off")
    ap.add_argument("--mla-override", type=json.loads, nargs="+", default=[],
                    help='also time the step with these fields replaced in the tuned MLA configuration, '
                         'e.g. \'{"slots": true}\'')
    ap.add_argument("--gate-parts", type=int, nargs="+", default=[],
                    help="also time the step with the router's partial logits in this many parts")
    ap.add_argument("--shared-fusion", action="store_true",
                    help="also time the step with the shared expert fused into the MoE kernels and as its own MLP")
    ap.add_argument("--overlap", action="store_true",
                    help="also time the step with its side-stream branches on and off (EngineConfig.decode_overlap)")
    ap.add_argument("--select", action="store_true",
                    help="also time the step with the indexer's top-k selected in one launch and in several "
                         "(radix passes up to 128K, torch.topk past it)")
    ap.add_argument("--select-programs", type=int, nargs="*", default=[],
                    help="with --select: split rows over about this many programs in all")
    ap.add_argument("--step-parts", action="store_true",
                    help="also time the host parts of a CUDA-graph step (inputs, replay, sampling) one by one")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    ap.add_argument("--profile", default=None,
                    help="write the eager decode step's kernels (count, device time) per context here")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    cfg = preset(args.preset, max_position_embeddings=max(max(args.contexts) + 2, 4096))
    model = build_ours(cfg, args.device, dtype)
    bw = copy_bandwidth(args.device)
    rows = []
    runs = [(kv, gemm, freq, c, e) for e in sorted(args.expert_dtype, key=lambda e: e != "auto")
            for kv in args.kv_dtype for gemm in args.moe_gemm for freq in args.index_topk_freq for c in args.contexts]
    for kv_dtype, gemm, freq, context, expert_dtype in runs:
        blocks = args.batch * -(-(context + 1) // args.block_size)
        ecfg = EngineConfig(device=args.device, dtype=args.dtype, block_size=args.block_size, num_blocks=blocks,
                            max_num_seqs=args.batch, max_model_len=context + 1, kv_cache_dtype=kv_dtype, moe_gemm=gemm,
                            index_cache_dtype=args.index_dtype, index_topk_freq=freq,
                            cuda_graph_max_batch=args.batch, expert_dtype="fp8_e4m3" if expert_dtype.startswith("fp8") else "auto",
                            expert_activations=EXPERT_ACTIVATIONS.get(expert_dtype, "auto"))
        engine = LLMEngine(model, None, ecfg)
        batch = make_batch(engine, args.batch, context)
        fwd, step = time_forward(engine, batch, args.iters)
        touched = experts_touched(engine, batch)
        nbytes = step_bytes(engine, args.batch, context, touched)
        roof = nbytes / bw * 1e3 if bw else None
        row = dict(preset=args.preset, device=args.device, batch=args.batch, context=context, kv_dtype=kv_dtype,
                   expert_dtype=expert_dtype, index_dtype=str(engine.runner.kv.index_keys.dtype).removeprefix("torch.")
                   if engine.runner.kv.index_keys is not None else None, index_topk_freq=freq, moe_gemm=gemm,
                   graphs=engine.runner.graphs is not None, pdl=pdl.pdl_mode(torch.empty(0, device=args.device)),
                   tuned_table=tuning.table_name(torch.device(args.device)),
                   forward_ms=round(fwd, 3), step_ms=round(step, 3),
                   tok_s=round(args.batch / fwd * 1e3, 1), bytes_per_step_gb=round(nbytes / 1e9, 3),
                   copy_gbs=bw and round(bw / 1e9, 1), roofline_ms=roof and round(roof, 3),
                   roofline_pct=roof and round(100 * roof / fwd, 1),
                   experts_touched_mean=round(sum(touched) / len(touched), 1),
                   routed_expert_gb=round(sum(t.numel() * t.element_size() for m in engine.runner.model.moe_layers()
                                              for t in m.slot_tensors()) / 1e9, 3))
        if args.graphs_vs_eager and engine.runner.graphs is not None:
            graphs, engine.runner.graphs = engine.runner.graphs, None
            row["eager_forward_ms"] = round(time_forward(engine, batch, args.iters)[0], 3)
            row["graph_speedup"] = round(row["eager_forward_ms"] / fwd, 2)
            engine.runner.graphs = graphs
        if args.moe_share:
            undo = without_moe(engine)
            if engine.runner.graphs is not None:
                engine.runner.graphs.clear()
            no_moe = time_forward(engine, batch, args.iters)[0]
            undo()
            row.update(no_moe_forward_ms=round(no_moe, 3), moe_share=round(1 - no_moe / fwd, 3))
        if args.unfused_gate:
            row["unfused_gate_forward_ms"] = round(time_changed(engine, batch, args.iters, unfused_gate), 3)
        if args.unfused_small:
            row["unfused_small_forward_ms"] = round(time_changed(engine, batch, args.iters, unfused_small), 3)
        if args.mla_gluon:
            for on in (True, False):
                ms = time_changed(engine, batch, args.iters, mla_gluon(on))
                row[f"mla_gluon_{'on' if on else 'off'}_forward_ms"] = round(ms, 3)
        for fields in args.mla_override:
            ms = time_changed(engine, batch, args.iters, mla_override(fields))
            row[f"mla_{json.dumps(fields, sort_keys=True)}_forward_ms"] = round(ms, 3)
        for parts in args.gate_parts:
            row[f"gate_parts_{parts}_forward_ms"] = round(time_changed(engine, batch, args.iters, gate_parts(parts)), 3)
        if args.shared_fusion:
            for on in (True, False):
                ms = time_changed(engine, batch, args.iters, shared_fusion(engine, on))
                row[f"shared_fusion_{'on' if on else 'off'}_forward_ms"] = round(ms, 3)
        if args.overlap:
            for on in (True, False):
                ms = time_changed(engine, batch, args.iters, overlap(engine, on))
                row[f"overlap_{'on' if on else 'off'}_forward_ms"] = round(ms, 3)
        if args.select:
            choices = [("fused", 1 << 30, None), ("multi", 0, None)]
            choices += [(f"fused_p{n}", 1 << 30, n) for n in args.select_programs]
            for name, width, programs in choices:
                ms = time_changed(engine, batch, args.iters, select_method(width, programs))
                row[f"select_{name}_forward_ms"] = round(ms, 3)
        if args.step_parts:
            row.update(step_parts(engine, batch, args.iters))
        if args.profile:
            row["kernels_per_step"] = profile_step(engine, batch, args.profile, f"batch {args.batch}, context {context}")
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine, batch
        gc.collect()  # the engine's graphs and KV pool, before the next engine allocates its own
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    base = rows[0]["forward_ms"] if rows else None
    print("\n| experts | kv | moe gemm | index freq | context | batch | forward ms | step ms | vs first | roofline ms "
          "| % roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['expert_dtype']} | {r['kv_dtype']} | {r['moe_gemm']} | {r['index_topk_freq']} | {r['context']} | "
              f"{r['batch']} | "
              f"{r['forward_ms']} | {r['step_ms']} | "
              f"{r['forward_ms'] / base - 1:+.1%} | {r['roofline_ms']} | {r['roofline_pct']} |")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
