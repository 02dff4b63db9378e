"""TTFT and inter-token latency of concurrent streaming sessions over HTTP, P/D vs decode-local.

    .venv/bin/python -m bench.serve_latency --sessions 8 --turns 3

Starts the Serve application twice on a local Ray (the same tiny model): once with every
prompt prefilled on a prefill server and its KV pushed over NIXL (`local_prefill_max_tokens: 0`),
once with prefill on the decode ranks (`kv_transport.backend: none`). Each session sends
`turns` chat turns, each turn's prompt growing by the previous answer plus new user text.
Also reports the time from `serve.run` to the first answered request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time

import httpx
import ray
from ray import serve

from app.main import build_app

ENGINE = {"block_size": 16, "num_blocks": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 512}
USER_TEXT = "Please look at this tool output and tell me what to change next. " * 6


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def session(client: httpx.AsyncClient, url: str, sid: str, turns: int, max_tokens: int, rows: list):
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"[{sid} turn {t}] " + USER_TEXT})
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        start = time.perf_counter()
        stamps, text = [], []
        async with client.stream("POST", url, json=body, headers={"x-session-id": sid}) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    stamps.append(time.perf_counter())
                    text.append(delta)
        rows.append({"turn": t, "ttft": stamps[0] - start,
                     "itl": [b - a for a, b in zip(stamps, stamps[1:])]})
        messages.append({"role": "assistant", "content": "".join(text)})


async def drive(port: int, sessions: int, turns: int, max_tokens: int) -> list:
    rows: list = []
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(session(client, url, f"s{i}", turns, max_tokens, rows) for i in range(sessions)))
    return rows


def run_mode(ckpt: str, mode: str, sessions: int, turns: int, max_tokens: int, ep: bool) -> dict:
    kv = ({"backend": "nixl", "local_prefill_max_tokens": 0, "timeout_s": 30} if mode == "pd"
          else {"backend": "none"})
    args = {"model": {"path": ckpt, "name": "tiny"}, "engine": ENGINE, "prefill": {"replicas": 1},
            "decode": {"dp_size": 2, "expert_parallel": ep}, "kv_transport": kv, "eplb": {"enabled": False}}
    port = _port()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", _temp_dir=tempfile.mkdtemp())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": "warm up", "max_tokens": 2}).raise_for_status()
        ready = time.perf_counter() - t0
        rows = asyncio.run(drive(port, sessions, turns, max_tokens))
        stats = serve.get_deployment_handle("DecodeGroup", app_name="wideep").stats.remote().result()
    finally:
        serve.shutdown()
        ray.shutdown()
    itl = [x for r in rows for x in r["itl"]]
    first = [r["ttft"] for r in rows if r["turn"] == 0]
    later = [r["ttft"] for r in rows if r["turn"] > 0]
    return {"mode": mode, "expert_parallel": ep, "ready_s": round(ready, 1), "requests": len(rows),
            "ttft_p50_ms": round(1000 * statistics.median(first + later), 1),
            "ttft_p90_ms": round(1000 * pct(first + later, 0.9), 1),
            "ttft_turn1_p50_ms": round(1000 * statistics.median(first), 1),
            "ttft_later_p50_ms": round(1000 * statistics.median(later), 1) if later else None,
            "itl_p50_ms": round(1000 * statistics.median(itl), 1), "itl_p90_ms": round(1000 * pct(itl, 0.9), 1),
            "prefill_remote": sum(s["prefill_remote"] for s in stats),
            "kv_bytes": sum(s["kv_bytes_received"] for s in stats),
            "prefix_hit_tokens": sum(s["prefix_hit_tokens"] for s in stats)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["pd", "local"])
    ap.add_argument("--ep", choices=["on", "off"], default="off",
                    help="decode ranks share the experts (lockstep EP) or each holds all of them")
    args = ap.parse_args(argv)
    from engine.checkpoint import write_random_checkpoint
    from engine.config import preset

    ckpt = str(write_random_checkpoint(preset("tiny"), tempfile.mkdtemp(), progress=False))
    for mode in args.modes:
        print(json.dumps(run_mode(ckpt, mode, args.sessions, args.turns, args.max_tokens, args.ep == "on")),
              flush=True)


if __name__ == "__main__":
    main()
