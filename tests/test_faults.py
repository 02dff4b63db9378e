"""Overload and faults on the real Serve application: bounded admission, a decode rank killed
mid-stream, a prefill replica killed, KV transfers that stall. Nothing hangs, nothing leaks."""
import asyncio
import socket
import time

import pytest
import ray
from ray import serve

from app.main import build_app

httpx = pytest.importorskip("httpx2")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def app_factory(tiny_ckpt, tmp_path_factory):
    started = []

    def start(**overrides):
        port = _port()
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
                 logging_level="ERROR")
        started.append(True)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"model": {"path": str(tiny_ckpt), "name": "tiny"},
                "engine": {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, "remote_kv_grace_s": 0.5},
                "eplb": {"enabled": False}, **overrides}
        serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
        return port, serve.get_deployment_handle("DecodeGroup", app_name="wideep")
    yield start
    if started:
        serve.shutdown()
        ray.shutdown()


def _req(rid, n=30, prompt=None, **sampling):
    return {"request_id": rid, "prompt_token_ids": prompt or list(range(10, 40)),
            "sampling": {"max_tokens": n, "temperature": 0, "ignore_eos": True, **sampling}}


# Penalties read the tokens produced so far, which a retry moves into the prompt.
PENALIZED = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
# So does a grammar's place: a retry that started the grammar over would write the x again.
CONSTRAINED = {"structured_output": {"kind": "regex", "value": "x[a-c]{60}"}}
KINDS = ({}, PENALIZED, CONSTRAINED)


def _drained(group, bound_s=20):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        stats = group.stats.remote().result()
        if all(s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0 and s["awaiting_kv"] == 0
               and s["quarantined_blocks"] == 0 for s in stats):
            return stats
        time.sleep(0.2)
    raise AssertionError(f"KV pools not empty after {bound_s} s: {stats}")


def test_decode_rank_killed_during_streams_and_prefill_replica_killed(app_factory):
    port, group = app_factory(decode={"dp_size": 2}, prefill={"replicas": 1},
                              kv_transport={"backend": "nixl", "local_prefill_max_tokens": 0, "timeout_s": 10},
                              routing={"max_requests_per_rank": 16, "token_timeout_s": 30})
    streaming = group.options(stream=True)
    expected = [t for out in streaming.generate.remote(_req("ref"), None) for t in out["new_token_ids"]]
    expected_kinds = [[t for out in streaming.generate.remote(_req(f"ref-{k}", **kind), None)
                       for t in out["new_token_ids"]] for k, kind in enumerate(KINDS)]
    assert len({tuple(e) for e in expected_kinds}) == 3 and expected_kinds[0] == expected

    async def one(i, seen_tokens):
        tokens, last = [], None
        async for out in streaming.generate.remote(_req(f"s{i}", **KINDS[i % 3]), f"session-{i}"):
            tokens += out["new_token_ids"]
            seen_tokens[0] += len(out["new_token_ids"])
            last = out
        return tokens, last

    async def main():
        seen = [0]
        tasks = [asyncio.ensure_future(one(i, seen)) for i in range(16)]
        while seen[0] < 40:  # everyone is streaming
            await asyncio.sleep(0.01)
        victim = (await group.rank_actors.remote())[0]
        t_kill = time.monotonic()
        ray.kill(victim, no_restart=True)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)  # nothing hangs past this bound
        return results, t_kill

    results, t_kill = asyncio.run(main())
    for i, (tokens, last) in enumerate(results):
        assert last["finished"]
        if last["finish_reason"] == "error":
            assert "decode failed" in last["error"]
        else:  # retried from its tokens so far: the same greedy continuation
            assert tokens == expected_kinds[i % 3]
    assert sum(last["finish_reason"] == "length" for _, last in results) >= 14
    info = group.info.remote().result()
    assert info["generation"] == 1 and info["recoveries"]
    # The rebuilt group serves again.
    after = [t for out in streaming.generate.remote(_req("after"), None) for t in out["new_token_ids"]]
    assert after == expected
    print(f"recovered in {time.monotonic() - t_kill:.1f} s; rebuild {info['recoveries'][0]['seconds']:.1f} s")
    _drained(group)

    # A prefill replica dies: requests fall back to prefill on the decode rank.
    before = sum(s["prefill_fallback"] for s in group.stats.remote().result())
    for name in ray.util.list_named_actors(all_namespaces=True):
        if "PrefillServer" in name["name"]:
            ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=False)
    out = [t for o in streaming.generate.remote(_req("no-prefill", prompt=list(range(50, 90))), None)
           for t in o["new_token_ids"]]
    assert len(out) == 30
    stats = group.stats.remote().result()
    assert sum(s["prefill_fallback"] for s in stats) + sum(s["prefill_remote"] for s in stats) > before
    _drained(group)


def test_overload_sheds_fast_and_stalled_transfers_recompute(app_factory):
    port, group = app_factory(decode={"dp_size": 1}, prefill={"replicas": 1},
                              kv_transport={"backend": "nixl", "local_prefill_max_tokens": 0, "timeout_s": 0.001},
                              routing={"max_requests_per_rank": 2})
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i):
                t0 = time.monotonic()
                r = await client.post(url, json={"prompt": list(range(10 + i, 40 + i)), "max_tokens": 20,
                                                 "ignore_eos": True, "temperature": 0})
                return r, time.monotonic() - t0
            return await asyncio.gather(*(one(i) for i in range(20)))  # 10x the admitted capacity

    results = asyncio.run(burst())
    shed = [(r, dt) for r, dt in results if r.status_code == 503]
    admitted = [(r, dt) for r, dt in results if r.status_code == 200]
    assert len(shed) + len(admitted) == 20 and shed and admitted
    for r, dt in shed:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    assert max(dt for _, dt in shed) < min(dt for _, dt in admitted)  # shed at once, not after queueing
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r, _ in admitted)
    # Every transfer "stalled" past its 1 ms limit: each prompt was recomputed on the decode rank.
    stats = group.stats.remote().result()[0]
    assert stats["prefill_fallback"] >= len(admitted) and stats["prefill_remote"] == 0
    _drained(group)  # abandoned reservations came back after their grace period
