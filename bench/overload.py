"""A burst of 10x the admitted capacity against the Serve application: how many requests are
admitted and shed, how fast the shed ones hear so, the latency of the admitted ones, and the
resident memory of the serving processes before and after.

    .venv/bin/python -m bench.overload --burst 160 --per-rank 8
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import time

from pathlib import Path

import httpx2 as httpx
import ray
from ray import serve

from app.main import build_app
from engine.checkpoint import write_random_checkpoint
from engine.config import preset


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_rss_mb() -> float:
    """Resident memory of this machine's Ray worker processes (the deployments and ranks)."""
    total_kb = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "ray::" in cmd or "default_worker" in cmd:
                rss = [ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("VmRSS:")]
                total_kb += int(rss[0].split()[1]) if rss else 0
        except OSError:  # the process ended meanwhile
            continue
    return total_kb / 1024


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def burst(url: str, n: int, max_tokens: int):
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=n)) as client:
        async def one(i):
            t0 = time.monotonic()
            r = await client.post(url, json={"prompt": list(range(10 + i % 50, 60 + i % 50)), "max_tokens": max_tokens,
                                             "ignore_eos": True, "temperature": 0})
            return r.status_code, time.monotonic() - t0, r.headers.get("retry-after")
        return await asyncio.gather(*(one(i) for i in range(n)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=160)
    ap.add_argument("--per-rank", type=int, default=8, help="routing.max_requests_per_rank")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    ckpt = str(write_random_checkpoint(preset("tiny"), tempfile.mkdtemp(), progress=False))
    port = _port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", _temp_dir=tempfile.mkdtemp())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": {"path": ckpt, "name": "tiny"}, "decode": {"dp_size": args.dp},
                             "kv_transport": {"backend": "none"}, "eplb": {"enabled": False},
                             "routing": {"max_requests_per_rank": args.per_rank}}),
                  name="wideep", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}/v1/completions"
        asyncio.run(burst(url, 2, 4))
        rss0 = serving_rss_mb()
        t0 = time.monotonic()
        results = asyncio.run(burst(url, args.burst, args.max_tokens))
        wall = time.monotonic() - t0
        rss1 = serving_rss_mb()
    finally:
        serve.shutdown()
        ray.shutdown()
    admitted = [dt for code, dt, _ in results if code == 200]
    shed = [dt for code, dt, ra in results if code == 503 and ra]
    other = [code for code, _, _ in results if code not in (200, 503)]
    print(json.dumps({"burst": args.burst, "capacity": args.per_rank * args.dp, "admitted": len(admitted),
                      "shed_503": len(shed), "other_status": other, "wall_s": round(wall, 2),
                      "admitted_p50_s": round(pct(admitted, 0.5), 3), "admitted_p99_s": round(pct(admitted, 0.99), 3),
                      "shed_p50_ms": round(1000 * pct(shed, 0.5), 1) if shed else None,
                      "shed_max_ms": round(1000 * max(shed), 1) if shed else None,
                      "rss_before_mb": round(rss0), "rss_after_mb": round(rss1)}))


if __name__ == "__main__":
    main()
