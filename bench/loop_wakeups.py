"""Handing a step's outputs from the engine thread to the callers' event loop: one
`call_soon_threadsafe` per output against one per step (engine/async_engine.py batches).

    python -m bench.loop_wakeups --outputs 64 --steps 300

Median microseconds of the engine thread's time per step, the event loop consuming meanwhile.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time


def _put_all(puts):
    for queue, item in puts:
        queue.put_nowait(item)


async def _run(batched: bool, outputs: int, steps: int) -> float:
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(outputs)]
    times = []

    def engine_thread():
        for step in range(steps):
            t0 = time.perf_counter()
            if batched:
                loop.call_soon_threadsafe(_put_all, [(q, step) for q in queues])
            else:
                for q in queues:
                    loop.call_soon_threadsafe(q.put_nowait, step)
            times.append(time.perf_counter() - t0)
            time.sleep(0.001)  # the next step's forward

    async def reader(q):
        for _ in range(steps):
            await q.get()
    thread = threading.Thread(target=engine_thread)
    thread.start()
    await asyncio.gather(*(reader(q) for q in queues))
    thread.join()
    return statistics.median(times) * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--outputs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    for batched in (False, True, False, True):  # interleaved: this machine's noise hits both
        us = asyncio.run(_run(batched, args.outputs, args.steps))
        print(f"{'one wake-up a step' if batched else 'one wake-up an output'}: {us:.1f} us a step")


if __name__ == "__main__":
    main()
