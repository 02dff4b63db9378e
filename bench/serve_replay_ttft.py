"""Next-turn TTFT through the Serve application's HTTP API: bounded window replay vs exact vs none.

    python -m bench.serve_replay_ttft --config configs/agentx-h200x2.yaml \\
        --override '{prefill: {replicas: 0}, kv_transport: {backend: none}, decode: {dp_size: 2, expert_parallel: false}}' \\
        --contexts 8192 32768 100000 --modes bounded exact --json out.jsonl

The engine-level form is bench/replay_ttft.py; this one goes through ingress, session router
and decode rank, streaming over the OpenAI API. For each `engine.replay_mode` the app is started
once; for each context a fresh session sends `context` random tokens (the first turn: nothing
cached, `none`), then the same tokens plus `--new-tokens` more (`repeats` times, a new suffix
each time): a prefix hit whose window KV is rebuilt the mode's way. TTFT is the first streamed
token's arrival, median over the repeats. Before the measured pass, `--warmup` untimed passes
over the same contexts (other sessions, other tokens) build every kernel variant that prefill
and replay use, which the engine's decode warm-up does not cover: on the GPU the first pass of
a fresh app put 13.6 s on an 8K prefill and 1.2 s on its next turn.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys

from bench.agentx import client
from bench.agentx.__main__ import LocalServe, _merge, _model_facts, _wait_ready, app_args


async def _turn(url: str, model: str, tokens: list[int], session: str) -> dict:
    import httpx2
    body = {"model": model, "prompt": tokens, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx2.AsyncClient(base_url=url, timeout=600) as http:
        rec = await client._one(http, "/v1/completions", body, session)
    if not rec["ok"]:
        raise RuntimeError(f"request failed: {rec['error']}")
    return rec


def measure(url: str, model: str, vocab: int, contexts: list[int], new_tokens: int, repeats: int,
            mode: str, seed: int = 0, warmup_pass: bool = False) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for context in contexts:
        session = f"replay-{mode}-{context}-{rng.randrange(1 << 30)}"
        prompt = [rng.randrange(4, vocab) for _ in range(context)]
        cold = asyncio.run(_turn(url, model, prompt, session))
        hits = [asyncio.run(_turn(url, model, prompt + [rng.randrange(4, vocab) for _ in range(new_tokens)], session))
                for _ in range(repeats)]
        row = dict(mode=mode, context=context, new_tokens=new_tokens, none_ttft_ms=round(cold["ttft_s"] * 1e3, 1),
                   hit_ttft_ms=round(statistics.median(h["ttft_s"] for h in hits) * 1e3, 1),
                   hit_cached_tokens=min(h["cached_tokens"] for h in hits))
        print(("warm-up " if warmup_pass else "") + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="serve config file or YAML mapping of the app args")
    ap.add_argument("--override", action="append", default=[], help="YAML merged into the app args")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 100000])
    ap.add_argument("--modes", nargs="+", default=["bounded", "exact"], choices=["bounded", "exact"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes over the contexts before the measured one")
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--json", default=None, help="append JSON lines here")
    a = ap.parse_args(argv)
    base = app_args(a.config, a.override, None)
    facts = _model_facts(base)
    too_long = [c for c in a.contexts if c + a.new_tokens + 2 > facts["context"]]
    if too_long:
        ap.error(f"contexts {too_long} do not fit the app's context limit of {facts['context']} tokens")
    rows = []
    for mode in a.modes:
        with LocalServe(_merge(base, {"engine": {"replay_mode": mode}}), a.num_cpus) as srv:
            _wait_ready(srv.url, facts["name"])
            for w in range(a.warmup):
                measure(srv.url, facts["name"], facts["vocab_size"], a.contexts, a.new_tokens, 1, mode, seed=1 + w, warmup_pass=True)
            rows += measure(srv.url, facts["name"], facts["vocab_size"], a.contexts, a.new_tokens, a.repeats, mode)
    if a.json:
        with open(a.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\n| mode | context | first turn (no cache) ms | next turn (prefix hit) ms | cached tokens |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['context']} | {r['none_ttft_ms']} | {r['hit_ttft_ms']} | {r['hit_cached_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
