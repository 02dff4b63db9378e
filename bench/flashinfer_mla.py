"""FlashInfer's MLA decode against ours on the same top-k global keys (GPU).

    python -m bench.flashinfer_mla --batches 1 16 64 --backends fa2 fa3 --window 128 --json out.jsonl

Each sequence attends to `topk` of its `context` global latents (kv_lora 512 + rope 64, bf16,
paged in 64-slot blocks), as the sparse decode does after the indexer. Ours reads the top-k
positions through the block tables (`mla_decode_triton(..., topk_pos=...)`, its tuned config);
FlashInfer's `BatchMLAPagedAttentionWrapper` gets the same keys as one-slot pages (the way
sparse MLA is served through it), its caches as views of our latent rows. Both are captured in
a CUDA graph and timed by replay (CUDA events, median; a call that cannot be captured is timed
back to back and its row says "eager"); FlashInfer's `plan` runs on the host once per batch
composition and is timed apart. Errors are against the fp32 reference.

With `--window W` each row is timed a second time as the engine's decode step reads attention:
the top-k keys plus the sequence's ring of the last W window latents, whose oldest entry this
step's fresh latent replaces. Ours does it in one launch (its slot resolve before it). FlashInfer
needs the slot resolve (our launch), the ring write, a second call over the ring as one-slot pages
and a merge of the two partial softmaxes (`flashinfer.merge_state`); that is what replacing our
kernel would cost, and it is timed as one graph too. Without `--window` the keys are the top-k
alone and FlashInfer is given the slots, resolved outside the timing.

FlashInfer is not a dependency: the run needs it importable (bench/device/flashinfer.sh
installs the carried wheel); without it, only our kernel is timed.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from wideep_kernels.mla_decode import _resolve_slots_kernel, mla_decode_reference, mla_decode_triton

KV_LORA, ROPE, BLOCK = 512, 64, 64


def make_case(batch: int, heads: int, context: int, topk: int, device, seed: int = 0):
    """Random latents in shuffled 64-slot blocks, queries, and `topk` distinct positions per sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK)
    perm = torch.randperm(batch * blocks_per_seq, generator=g)
    tables = perm.view(batch, blocks_per_seq).int()
    kv = (torch.randn(batch * blocks_per_seq * BLOCK, KV_LORA + ROPE, generator=g) * 0.5).bfloat16()
    q_lat = torch.randn(batch, heads, KV_LORA, generator=g).bfloat16()
    q_rope = torch.randn(batch, heads, ROPE, generator=g).bfloat16()
    topk_pos = torch.stack([torch.randperm(context, generator=g)[:topk] for _ in range(batch)]).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    return tuple(t.to(device) for t in (q_lat, q_rope, kv, tables, lens, topk_pos))


def flashinfer_indices(tables: torch.Tensor, topk_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [B+1], kv_indices [B*K]) int32: each chosen position's slot as a one-slot page."""
    b, k = topk_pos.shape
    pos = topk_pos.long()
    slots = tables.long().gather(1, pos // BLOCK) * BLOCK + pos % BLOCK
    indptr = torch.arange(b + 1, device=tables.device, dtype=torch.int32) * k
    return indptr, slots.flatten().int()


def gathered_attention(q_lat, q_rope, kv, indptr, indices, sm_scale: float) -> torch.Tensor:
    """Plain fp32 attention over kv[indices] per sequence: what FlashInfer is asked to compute."""
    outs = []
    for i in range(q_lat.shape[0]):
        keys = kv[indices[indptr[i]:indptr[i + 1]].long()].float()
        q = torch.cat([q_lat[i], q_rope[i]], dim=-1).float()
        p = torch.softmax(q @ keys.T * sm_scale, dim=-1)
        outs.append(p @ keys[:, :KV_LORA])
    return torch.stack(outs)


def graph_time_ms(fn, iters: int) -> tuple[float, str]:
    """(median replay time of a CUDA graph holding one call of fn, "graph"); where fn cannot be
    captured, (mean time of `iters` calls launched back to back, "eager"), which counts the
    host's launch time wherever it exceeds the GPU's."""
    fn()  # builds and warms up outside the capture
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters, "eager"
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), "graph"


def run_flashinfer(backend: str, case, sm_scale: float, iters: int) -> dict:
    import flashinfer
    q_lat, q_rope, kv, tables, _, topk_pos = case
    b, h = q_lat.shape[:2]
    indptr, indices = flashinfer_indices(tables, topk_pos)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(128 << 20, dtype=torch.int8, device=kv.device), backend=backend)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=kv.device)
    kv_len = torch.full((b,), topk_pos.shape[1], dtype=torch.int32, device=kv.device)
    plan_args = (qo_indptr, indptr, indices, kv_len, h, KV_LORA, ROPE, 1, False, sm_scale, q_lat.dtype, kv.dtype)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wrapper.plan(*plan_args)  # builds (JIT) on first use
    torch.cuda.synchronize()
    start.record()
    wrapper.plan(*plan_args)
    end.record()
    end.synchronize()
    plan_ms = start.elapsed_time(end)
    # Our latent rows [S, 576] seen as FlashInfer's two caches of one-slot pages.
    ckv, kpe = kv[:, :KV_LORA].unsqueeze(1), kv[:, KV_LORA:].unsqueeze(1)
    layout = "views"
    try:
        out = wrapper.run(q_lat, q_rope, ckv, kpe)
    except Exception as e:  # a build that wants contiguous caches: time it on copies, and say so
        layout = f"copies ({type(e).__name__})"
        ckv, kpe = ckv.contiguous(), kpe.contiguous()
        out = wrapper.run(q_lat, q_rope, ckv, kpe)
    out_buf = torch.empty_like(q_lat)
    ms, timing = graph_time_ms(lambda: wrapper.run(q_lat, q_rope, ckv, kpe, out=out_buf), iters)
    return dict(ms=ms, timing=timing, plan_ms=plan_ms, layout=layout, out=out)


def make_ring(batch: int, window: int, device, seed: int = 1):
    """A window ring a sequence, this step's fresh latents, the ring entry each replaces
    (masked in win_valid, as decode passes it) and win_valid [B, W+1]."""
    g = torch.Generator().manual_seed(seed)
    ring_kv = (torch.randn(batch, window, KV_LORA + ROPE, generator=g) * 0.5).bfloat16()
    fresh = (torch.randn(batch, KV_LORA + ROPE, generator=g) * 0.5).bfloat16()
    write_idx = torch.randint(window, (batch,), generator=g)
    win_valid = torch.ones(batch, window + 1, dtype=torch.bool)
    win_valid[torch.arange(batch), write_idx] = False
    slots = torch.arange(batch)
    return tuple(t.to(device) for t in (ring_kv, slots, fresh, write_idx, win_valid))


def window_indices(ring_slots: torch.Tensor, window: int) -> torch.Tensor:
    """[B*W] int32: each sequence's ring entries as rows of ring_kv.view(-1, D), after this step's
    ring write (the fresh latent then sits at its write index, the entry it replaced gone)."""
    return (ring_slots.view(-1, 1) * window + torch.arange(window, device=ring_slots.device)).flatten().int()


def _plan(wrapper, indptr, indices, kv_len, heads, sm_scale, dtype):
    qo_indptr = torch.arange(indptr.numel(), dtype=torch.int32, device=indptr.device)
    wrapper.plan(qo_indptr, indptr, indices, kv_len, heads, KV_LORA, ROPE, 1, False, sm_scale, dtype, dtype)


def run_flashinfer_window(backend: str, case, ring, sm_scale: float, iters: int) -> dict:
    """FlashInfer in the engine's place: resolve, ring write, top-k call, window call, merge."""
    import flashinfer
    q_lat, q_rope, kv, tables, lens, topk_pos = case
    ring_kv, ring_slots, fresh, write_idx, _ = ring
    b, h = q_lat.shape[:2]
    k, w = topk_pos.shape[1], ring_kv.shape[1]
    dev = kv.device
    resolved = torch.empty(b * k, dtype=torch.int32, device=dev)
    main_w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.int8, device=dev),
                                                          backend=backend)
    win_w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.int8, device=dev),
                                                         backend=backend)
    # the plan keeps `resolved` by reference: the resolve launch rewrites it before each run
    _plan(main_w, torch.arange(b + 1, dtype=torch.int32, device=dev) * k, resolved,
          torch.full((b,), k, dtype=torch.int32, device=dev), h, sm_scale, q_lat.dtype)
    win_idx = window_indices(ring_slots, w)
    _plan(win_w, torch.arange(b + 1, dtype=torch.int32, device=dev) * w, win_idx,
          torch.full((b,), w, dtype=torch.int32, device=dev), h, sm_scale, q_lat.dtype)
    ckv, kpe = kv[:, :KV_LORA].unsqueeze(1), kv[:, KV_LORA:].unsqueeze(1)
    ring_rows = ring_kv.view(-1, KV_LORA + ROPE)
    ckv_w, kpe_w = ring_rows[:, :KV_LORA].unsqueeze(1), ring_rows[:, KV_LORA:].unsqueeze(1)
    write_rows = ring_slots * w + write_idx
    o1, o2 = torch.empty_like(q_lat), torch.empty_like(q_lat)
    s1 = torch.empty(b, h, dtype=torch.float32, device=dev)
    s2 = torch.empty_like(s1)

    def step():
        _resolve_slots_kernel[(-(-k // 1024), b)](
            topk_pos, topk_pos.stride(0), tables, tables.stride(0), tables.shape[1] * BLOCK, lens, resolved,
            k, BLOCK, BLOCK=1024, num_warps=4)
        ring_rows.index_copy_(0, write_rows, fresh)
        main_w.run(q_lat, q_rope, ckv, kpe, out=o1, lse=s1, return_lse=True)
        win_w.run(q_lat, q_rope, ckv_w, kpe_w, out=o2, lse=s2, return_lse=True)
        return flashinfer.merge_state(o1, s1, o2, s2)[0]
    out = step()
    ms, timing = graph_time_ms(step, iters)
    return dict(ms=ms, timing=timing, out=out)


def window_row(args, case, backends, sm_scale: float) -> dict:
    q_lat, q_rope, kv, tables, lens, topk_pos = case
    ring = make_ring(q_lat.shape[0], args.window, kv.device)
    ring_kv, ring_slots, fresh, write_idx, win_valid = ring
    ref = mla_decode_reference(torch.cat([q_lat, q_rope], -1).float(), kv.float(), None, tables, lens, BLOCK,
                               sm_scale, KV_LORA, topk_pos=topk_pos, win_valid=win_valid,
                               ring=(ring_kv.clone().float(), ring_slots, fresh.float(), write_idx))

    def ours():
        return mla_decode_triton((q_lat, q_rope), kv, None, tables, lens, BLOCK, sm_scale, KV_LORA,
                                 topk_pos=topk_pos, win_valid=win_valid, ring=(ring_kv, ring_slots, fresh, write_idx))
    ours_ms, _ = graph_time_ms(ours, args.iters)
    row = dict(batch=q_lat.shape[0], window=args.window, ours_win_us=round(ours_ms * 1e3, 1),
               ours_win_max_err=float((ours().float() - ref).abs().max()))
    for backend in backends:
        try:
            fi = run_flashinfer_window(backend, case, ring, sm_scale, args.iters)
            row[f"{backend}_win_us"] = round(fi["ms"] * 1e3, 1)
            row[f"{backend}_win_timing"] = fi["timing"]
            row[f"{backend}_win_max_err"] = float((fi["out"].float() - ref).abs().max())
        except Exception as e:
            row[f"{backend}_win_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--backends", nargs="+", default=["fa2", "fa3"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--window", type=int, default=0, help="also time the step's read with a ring of W window keys")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    try:
        import flashinfer
        version = flashinfer.__version__
    except ImportError:
        version = None
        print("flashinfer is not importable: timing ours only")
    sm_scale = (128 + ROPE) ** -0.5  # DeepSeek's qk head dim before absorption
    rows = []
    for b in args.batches:
        case = make_case(b, args.heads, args.context, args.topk, "cuda")
        q_lat, q_rope, kv, tables, lens, topk_pos = case
        ref = mla_decode_reference(torch.cat([q_lat, q_rope], -1).float(), kv.float(), None, tables, lens, BLOCK,
                                   sm_scale, KV_LORA, topk_pos=topk_pos)

        def ours():
            return mla_decode_triton((q_lat, q_rope), kv, None, tables, lens, BLOCK, sm_scale, KV_LORA,
                                     topk_pos=topk_pos)
        ours_ms, _ = graph_time_ms(ours, args.iters)
        row = dict(batch=b, heads=args.heads, context=args.context, topk=args.topk, ours_us=round(ours_ms * 1e3, 1),
                   ours_max_err=float((ours().float() - ref).abs().max()), flashinfer=version)
        for backend in args.backends if version else []:
            try:
                fi = run_flashinfer(backend, case, sm_scale, args.iters)
                row[f"{backend}_us"] = round(fi["ms"] * 1e3, 1)
                row[f"{backend}_timing"] = fi["timing"]
                row[f"{backend}_plan_us"] = round(fi["plan_ms"] * 1e3, 1)
                row[f"{backend}_layout"] = fi["layout"]
                row[f"{backend}_max_err"] = float((fi["out"].float() - ref).abs().max())
            except Exception as e:  # a backend this GPU or build lacks: say why, go on
                row[f"{backend}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if args.window:
            row.update(window_row(args, case, args.backends if version else [], sm_scale))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del case, ref
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
