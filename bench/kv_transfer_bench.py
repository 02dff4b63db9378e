"""Host-memory throughput of KVTransport.write_blocks against a plain torch copy of the same bytes.

Layout as in the `small` preset's global KV: 4 source layers, 16-token blocks, latent 576 plus
index keys 64, bfloat16. Each write moves N blocks of every tensor and layer; "scattered" picks
block ids with no two consecutive (one descriptor per block and layer), "contiguous" moves one
run (one descriptor per tensor and layer). NIXL time is write_blocks() until the sender's wait()
returns; the torch baseline gathers and scatters the same blocks inside one process.

    python -m bench.kv_transfer_bench --blocks 256 --iters 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from engine.kv_transfer import KVTransport

LAYERS, BLOCK, WIDTHS = 4, 16, (576, 64)
DTYPE = torch.bfloat16


def _pool(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYERS, num_blocks * BLOCK, w, generator=g).to(DTYPE) for w in WIDTHS]


def _patterns(n: int, pool_blocks: int) -> dict[str, tuple[list[int], list[int]]]:
    if 2 * n > pool_blocks:
        raise SystemExit("--pool-blocks must be at least 2 x --blocks for the scattered pattern")
    g = torch.Generator().manual_seed(0)
    # Even ids, shuffled: never two consecutive on either side, so nothing merges.
    src = (torch.randperm(pool_blocks // 2, generator=g)[:n] * 2).tolist()
    dst = (torch.randperm(pool_blocks // 2, generator=g)[:n] * 2).tolist()
    return {"contiguous": (list(range(n)), list(range(n, 2 * n))), "scattered": (src, dst)}


def _gib_s(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    med = statistics.median(seconds)
    return nbytes / med / 2**30, med * 1e3


def _torch_copy(src_pool, dst_pool, src, dst, iters):
    si, di = torch.tensor(src), torch.tensor(dst)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        for s, d in zip(src_pool, dst_pool):
            sv = s.view(LAYERS, -1, BLOCK * s.shape[2])
            dv = d.view(LAYERS, -1, BLOCK * d.shape[2])
            dv[:, di] = sv[:, si]
        times.append(time.perf_counter() - t0)
    return times[1:]


def _flat_copy(nbytes, iters):
    # The memcpy ceiling: the same number of bytes as one contiguous buffer.
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times[1:]


def _nixl_writes(a: KVTransport, peer: str, src, dst, iters, tag: str, receiver: KVTransport | None):
    times, handle = [], None
    for i in range(iters + 1):  # the first one also sets up the connection: not timed
        notif = f"{tag}-{i}".encode()
        t0 = time.perf_counter()
        handle = a.write_blocks(peer, src, dst, notif)
        a.wait(handle, timeout_s=60)
        times.append(time.perf_counter() - t0)
        if receiver is not None and not receiver.wait_notification(notif, timeout_s=60):
            raise RuntimeError(f"notification {notif!r} never arrived")
    return times[1:], handle


def _receiver(conn, pool_blocks, names, nixl_thread):
    with KVTransport("bench-receiver-xproc", _pool(pool_blocks, seed=2), BLOCK,
                     nixl_progress_thread=nixl_thread) as r:
        conn.send(r.metadata())
        for notif in names:
            if not r.wait_notification(notif, timeout_s=120):
                conn.send(f"missing {notif!r}")
                return
        conn.send("ok")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--pool-blocks", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-cross-process", action="store_true")
    ap.add_argument("--nixl-progress-thread", action="store_true",
                    help="also run NIXL's own (spinning) progress thread")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the copy baselines (NIXL's copy runs on one thread)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    patterns = _patterns(args.blocks, args.pool_blocks)
    a_pool, b_pool = _pool(args.pool_blocks, seed=1), _pool(args.pool_blocks, seed=2)
    nbytes = args.blocks * BLOCK * LAYERS * sum(WIDTHS) * a_pool[0].element_size()
    print(f"torch threads {torch.get_num_threads()}; {args.blocks} blocks x {LAYERS} layers x {BLOCK} tokens x ({' + '.join(map(str, WIDTHS))}) "
          f"{str(DTYPE).removeprefix('torch.')} = {nbytes / 2**20:.1f} MiB per write; "
          f"median of {args.iters}; NIXL progress thread {'on' if args.nixl_progress_thread else 'off'}")
    print("| pattern | method | descriptors | GiB/s | ms |")
    print("|---|---|---|---|---|")

    def row(pattern, method, descs, times):
        gbs, ms = _gib_s(nbytes, times)
        print(f"| {pattern} | {method} | {descs} | {gbs:.2f} | {ms:.2f} |", flush=True)

    thread = args.nixl_progress_thread
    with KVTransport("bench-a", a_pool, BLOCK, nixl_progress_thread=thread) as a, \
            KVTransport("bench-b", b_pool, BLOCK, nixl_progress_thread=thread) as b:
        peer = a.connect(b.metadata())
        row("-", "torch copy_ of one contiguous buffer", "-", _flat_copy(nbytes, args.iters))
        for name, (src, dst) in patterns.items():
            row(name, "torch gather/scatter copy", "-", _torch_copy(a_pool, b_pool, src, dst, args.iters))
            times, h = _nixl_writes(a, peer, src, dst, args.iters, f"in-{name}", b)
            for t in b_pool:
                t.zero_()
            _nixl_writes(a, peer, src, dst, 0, f"check-{name}", b)
            for s, d in zip(a_pool, b_pool):
                sv, dv = s.view(LAYERS, -1, BLOCK, s.shape[2]), d.view(LAYERS, -1, BLOCK, d.shape[2])
                if not torch.equal(sv[:, src], dv[:, dst]):
                    raise RuntimeError(f"{name}: destination blocks differ from the source")
            row(name, "NIXL write, in-process", h.num_descs, times)

        if not args.no_cross_process:
            ctx = mp.get_context("spawn")
            names = [f"x-{p}-{i}".encode() for p in patterns for i in range(args.iters + 1)]
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_receiver, args=(child, args.pool_blocks, names, thread), daemon=True)
            proc.start()
            xpeer = a.connect(parent.recv())
            for name, (src, dst) in patterns.items():
                times, h = _nixl_writes(a, xpeer, src, dst, args.iters, f"x-{name}", None)
                row(name, "NIXL write, cross-process", h.num_descs, times)
            verdict = parent.recv()
            proc.join(30)
            if verdict != "ok":
                raise RuntimeError(f"receiver process: {verdict}")


if __name__ == "__main__":
    main()
