"""Throughput of the same-host KV transport (engine/kv_ipc.py) against a plain peer copy of the
same bytes, in one run.

The bench model's global KV: 4 KV-source layers x 576 bf16 values per token, 64-token blocks.
For 8K / 32K / 100K tokens' worth of blocks, a writer process (prefill, GPU 0) writes its blocks
into scattered blocks of a pool exported by another process (decode, GPU 1) and waits for them,
as PrefillWorker does; then the same number of blocks as one run on both sides (the transport's
run-by-run copy) and that run through the gather + scatter kernels the scattered case uses.
The baseline is dst.copy_(src) of the same number of bytes, contiguous, cuda:0 -> cuda:1 in the
writer process. After the timed writes the decode process checksums its destination blocks
against the source blocks. On CPU the pool is in /dev/shm and the baseline is a memcpy.

Visibility: "isolated" starts the decode process with only its GPU visible (what Ray does to a
GPU actor; it calls that GPU cuda:0), "shared" lets it see both (it uses cuda:1). The writer
always sees every GPU, to run the baseline.

    python -m bench.kv_ipc_bench                    # CUDA with 2 GPUs: both visibilities
    python -m bench.kv_ipc_bench --device cpu       # quick: a /dev/shm pool, 8K tokens
    python -m bench.kv_ipc_bench --probe-exit       # CUDA: a write after the exporter exited
    python -m bench.kv_ipc_bench --serve auto ipc   # the Serve app, prefill GPU -> decode GPU (Ray)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

from engine.kv_ipc import IpcTransport, ShmPool
from engine.shm_pool import SHM_DIR, sweep_stale

LAYERS, WIDTH, DTYPE = 4, 576, torch.bfloat16


def _slots(blocks: int, block_size: int) -> int:
    return blocks * block_size


def _block_sums(t: torch.Tensor, ids: list[int], block_size: int) -> list[float]:
    """One exact checksum per block: its bytes as int16, summed in float64 (bit-for-bit copies
    give equal sums; a wrong or missing block does not)."""
    v = t.view(LAYERS, -1, block_size * WIDTH)[:, ids]
    w = v.contiguous().view(torch.int16).to(torch.float64)
    weights = torch.arange(1, w.shape[-1] + 1, dtype=torch.float64, device=w.device)
    return (w * weights).sum(dim=(0, 2)).cpu().tolist()


def _decode(conn, device: str, pool_blocks: int, block_size: int, visible: str | None) -> None:
    if visible is not None:
        assert torch.cuda.device_count() == 1, "CUDA_VISIBLE_DEVICES was not applied"
    shape = (LAYERS, _slots(pool_blocks, block_size), WIDTH)
    if device == "cpu":
        pool = ShmPool()
        kv = pool("global_kv", torch.zeros(shape, dtype=DTYPE))
    else:
        torch.cuda.set_device(device)
        kv = torch.zeros(shape, dtype=DTYPE, device=device)
    t = IpcTransport("decode", [kv], block_size)
    conn.send(t.metadata())
    while True:
        msg = conn.recv()
        if msg is None:
            break
        conn.send(_block_sums(kv, msg, block_size))
    t.close()


def _start_decode(ctx, device: str, pool_blocks: int, block_size: int, visible: str | None):
    parent, child = ctx.Pipe()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        proc = ctx.Process(target=_decode, args=(child, device, pool_blocks, block_size, visible), daemon=True)
        proc.start()
    finally:
        if visible is not None and old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    if not parent.poll(120):
        raise SystemExit(f"decode process did not start (exit code {proc.exitcode})")
    return proc, parent, parent.recv()


def _sync(device: str) -> None:
    if device != "cpu":
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _timed(fn, iters: int, device: str) -> list[float]:
    fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def _peer_copy(nbytes: int, device: str, iters: int) -> list[float]:
    if device == "cpu":
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    else:
        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    return _timed(lambda: b.copy_(a), iters, device)


def run(device: str, visibility: str, tokens: list[int], block_size: int, iters: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    max_blocks = -(-max(tokens) // block_size)
    pool_blocks = 2 * max_blocks + 1  # room to scatter: every other block at most
    if device == "cpu":
        dec_dev, visible, src_dev = "cpu", None, "cpu"
    elif visibility == "isolated":
        dec_dev, visible, src_dev = "cuda:0", "1", "cuda:0"
    else:
        dec_dev, visible, src_dev = "cuda:1", None, "cuda:0"
    proc, conn, meta = _start_decode(ctx, dec_dev, pool_blocks, block_size, visible)
    rows = []
    try:
        g = torch.Generator().manual_seed(0)
        # Drawn where it lives: ~1 GB of random bf16 on the host would take seconds.
        src_pool = torch.randn(LAYERS, _slots(pool_blocks, block_size), WIDTH, dtype=DTYPE, device=src_dev,
                               generator=torch.Generator(device=src_dev).manual_seed(1))
        with IpcTransport("prefill", [src_pool], block_size) as p:
            peer = p.connect(meta)
            for n_tokens in tokens:
                n = -(-n_tokens // block_size)
                # Scattered on both sides: shuffled even block ids, never two neighbours.
                src = (torch.randperm(pool_blocks // 2, generator=g)[:n] * 2).tolist()
                dst = (torch.randperm(pool_blocks // 2, generator=g)[:n] * 2).tolist()
                nbytes = n * LAYERS * block_size * WIDTH * src_pool.element_size()
                write = _timed(lambda: p.wait(p.write_blocks(peer, src, dst), 60), iters, device)
                conn.send(dst)
                exact = conn.recv() == _block_sums(src_pool, src, block_size)
                # The contiguous case for comparison: the same number of blocks, one run each side.
                run_write = _timed(lambda: p.wait(p.write_blocks(peer, list(range(n)), list(range(n))), 60),
                                   iters, device)
                p.copy_mode = "indexed"  # the same run through the gather + scatter kernels
                run_indexed = _timed(lambda: p.wait(p.write_blocks(peer, list(range(n)), list(range(n))), 60),
                                     iters, device)
                p.copy_mode = "auto"
                peer_copy = _peer_copy(nbytes, device, iters)
                med = {k: statistics.median(v) for k, v in
                       (("scattered", write), ("contiguous", run_write), ("contiguous_indexed", run_indexed),
                        ("peer", peer_copy))}
                rows.append({
                    "device": device, "visibility": visibility if device != "cpu" else "-", "tokens": n_tokens,
                    "blocks": n, "MiB": round(nbytes / 2**20, 1),
                    "ipc_scattered_GiB_s": round(nbytes / med["scattered"] / 2**30, 1),
                    "ipc_scattered_ms": round(med["scattered"] * 1e3, 3),
                    "ipc_contiguous_GiB_s": round(nbytes / med["contiguous"] / 2**30, 1),
                    "ipc_contiguous_indexed_GiB_s": round(nbytes / med["contiguous_indexed"] / 2**30, 1),
                    "peer_copy_GiB_s": round(nbytes / med["peer"] / 2**30, 1),
                    "ipc_vs_peer": round(med["peer"] / med["scattered"], 2),
                    "exact": exact,
                })
                print(json.dumps(rows[-1]), flush=True)
    finally:
        conn.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def _probe_writer(conn, meta: dict, block_size: int, connect_first: bool) -> None:
    src = torch.ones(LAYERS, _slots(8, block_size), WIDTH, dtype=DTYPE, device="cuda:0")
    p = IpcTransport("prefill", [src], block_size)
    result = {}
    try:
        if connect_first:
            p.connect(meta)
        conn.send("ready")
        conn.recv()  # the exporter has exited
        peer = p.connect(meta)
        p.wait(p.write_blocks(peer, list(range(8)), list(range(8))), 10)
        torch.cuda.synchronize()
        result = {"write": "completed"}
    except Exception as e:
        result = {"write": "raised", "error": f"{type(e).__name__}: {e}"[:300]}
    try:  # is this process's CUDA context still usable afterwards?
        result["context_ok"] = bool((torch.ones(4, device="cuda:0") * 2).sum().item() == 8)
    except Exception as e:
        result["context_ok"] = f"{type(e).__name__}: {e}"[:200]
    conn.send(result)


def probe_exporter_exit(block_size: int) -> list[dict]:
    """What a writer sees when the decode process that exported the pool has exited: with the
    pool opened before the exit, and opened only after it."""
    ctx = mp.get_context("spawn")
    out = []
    for connect_first in (True, False):
        proc, conn, meta = _start_decode(ctx, "cuda:0", 16, block_size, "1")
        parent, child = ctx.Pipe()
        writer = ctx.Process(target=_probe_writer, args=(child, meta, block_size, connect_first), daemon=True)
        writer.start()
        assert parent.poll(120), "writer did not start"
        parent.recv()
        conn.send(None)
        proc.join(30)
        parent.send("go")
        res = parent.recv() if parent.poll(60) else {"write": "no answer"}
        writer.join(30)
        res.update(opened_before_exit=connect_first, exporter_exitcode=proc.exitcode, writer_exitcode=writer.exitcode)
        print(json.dumps(res), flush=True)
        out.append(res)
    return out


def serve_smoke(backend: str, device: str) -> dict:
    """The Serve application with the tiny model, prefill and decode on one GPU each (Ray gives
    each its own CUDA_VISIBLE_DEVICES), every prompt prefilled remotely: the decode output must
    equal the engine alone and the counters say which transport moved the KV. The only part of
    this bench that needs Ray."""
    import socket

    import ray
    from ray import serve

    from app.main import CHECKPOINT_ROOT, build_app
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.checkpoint import ensure_checkpoint

    engine = {"dtype": "bfloat16", "block_size": 16, "max_num_batched_tokens": 256}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gpu = device == "cuda"
    ray.init(num_gpus=2 if gpu else 0, num_cpus=8 if gpu else 2, include_dashboard=False, logging_level="ERROR")
    report = {"backend": backend, "device": device}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(build_app({
            "model": {"preset": "tiny"}, "engine": engine,
            "prefill": {"replicas": 1, "devices": device}, "decode": {"dp_size": 1, "devices": device},
            "kv_transport": {"backend": backend, "local_prefill_max_tokens": 0, "timeout_s": 30},
            "placement": {"ingress_cpus": 1}}), name="wideep", route_prefix="/", blocking=False)
        report["ready_s"] = round(time.perf_counter() - t0, 1)
        group = serve.get_deployment_handle("DecodeGroup", app_name="wideep")
        alone = LLMEngine.from_pretrained(ensure_checkpoint("tiny", root=CHECKPOINT_ROOT),
                                          EngineConfig(device=device, **engine), progress=False)
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        same = []
        for i in range(3):
            prompt = [(10 + i + 7 * j) % 500 + 5 for j in range(200 * (i + 1))]
            req = {"request_id": f"r{i}", "prompt_token_ids": prompt,
                   "sampling": {"max_tokens": 16, "temperature": 0, "ignore_eos": True}}
            got = [t for o in group.options(stream=True).generate.remote(req, None) for t in o["new_token_ids"]]
            same.append(got == alone.generate([prompt], greedy)[0].output_token_ids)
        stats = group.stats.remote().result()[0]
        report.update(same_as_alone=same, **{k: stats[k] for k in (
            "kv_transport", "prefill_remote", "prefill_fallback", "kv_transfers_ipc", "kv_transfers_nixl",
            "kv_bytes_received", "kv_blocks_used")})
        prefill = serve.get_deployment_handle("PrefillServer", app_name="wideep").stats.remote().result()
        report.update(prefill_kv_transfers_ipc=prefill["kv_transfers_ipc"], prefill_held_kv=prefill["held_kv"])
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"[-1500:]
    finally:
        serve.shutdown()
        ray.shutdown()
        time.sleep(0.5)
        sweep_stale(SHM_DIR)  # Ray ends the decode rank without its exit hooks (CPU pool files)
    print(json.dumps(report), flush=True)
    return report


def _table(rows: list[dict]) -> str:
    cols = ["device", "visibility", "tokens", "blocks", "MiB", "ipc_scattered_GiB_s", "ipc_scattered_ms",
            "ipc_contiguous_GiB_s", "ipc_contiguous_indexed_GiB_s", "peer_copy_GiB_s", "ipc_vs_peer", "exact"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.device_count() >= 2 else "cpu")
    ap.add_argument("--visibility", choices=["isolated", "shared", "both"], default="both")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="token counts to move (default: 8192 32768 102400 on CUDA, 8192 on CPU)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=None, help="timed writes per size (default 20 CUDA, 5 CPU)")
    ap.add_argument("--probe-exit", action="store_true",
                    help="CUDA: instead, report what a write does once the exporting process has exited")
    ap.add_argument("--serve", nargs="+", metavar="BACKEND", choices=["ipc", "auto", "nixl"],
                    help="instead, the Serve application with these kv_transport backends (needs Ray)")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.serve:
        reports = [serve_smoke(b, args.device) for b in args.serve]
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"serve": reports}, f, indent=1)
        return
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit("--device cuda needs 2 GPUs (the decode pool on GPU 1, the writer on GPU 0)")
    if args.probe_exit:
        probe = probe_exporter_exit(args.block_size)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"probe_exit": probe}, f, indent=1)
        return
    tokens = args.tokens or ([8192, 32768, 102400] if args.device == "cuda" else [8192])
    iters = args.iters or (20 if args.device == "cuda" else 5)
    vis = ["isolated", "shared"] if args.visibility == "both" else [args.visibility]
    rows = []
    for v in (vis if args.device == "cuda" else ["-"]):
        rows += run(args.device, v, tokens, args.block_size, iters)
    print(_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}, f, indent=1)


if __name__ == "__main__":
    main()
