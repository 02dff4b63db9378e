"""The Serve application with kv_transport 'ipc' (CPU: the decode rank's KV pool lives in /dev/shm
files the prefill server maps): a remote prefill's output equals decode alone, the KV really
moved over IPC (counters, exact byte count, no NIXL), and a transfer later than its limit falls
back to prefill on the decode rank with nothing leaked. 'auto' on CPU still goes over NIXL."""
import socket
import time

import pytest
import ray
from ray import serve

from app.main import build_app
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.shm_pool import SHM_DIR, sweep_stale

ENGINE = {"block_size": 4, "num_blocks": 128, "max_num_seqs": 4, "max_num_batched_tokens": 128,
          "remote_kv_grace_s": 0.5}


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deploy(tiny_ckpt, timeout_s, backend="ipc"):
    args = {"model": {"path": str(tiny_ckpt), "name": "tiny"}, "engine": ENGINE,
            "prefill": {"replicas": 1}, "decode": {"dp_size": 1},
            "kv_transport": {"backend": backend, "local_prefill_max_tokens": 0, "timeout_s": timeout_s},
            "eplb": {"enabled": False}}
    serve.run(build_app(args), name="wideep", route_prefix="/", blocking=False)
    return serve.get_deployment_handle("DecodeGroup", app_name="wideep")


def test_config_kv_transport_modes():
    from app.config import ConfigError, parse_app_config

    assert parse_app_config({}).kv_transport.mode == "auto"
    assert parse_app_config({"kv_transport": {"backend": "ipc"}}).kv_transport.mode == "ipc"
    gpus = {"prefill": {"devices": "cuda"}, "decode": {"devices": "cuda"}}
    assert parse_app_config({**gpus, "kv_transport": {"backend": "cuda_ipc"}}).kv_transport.mode == "ipc"
    with pytest.raises(ConfigError, match="'nccl' is not implemented"):
        parse_app_config({"kv_transport": {"backend": "nccl"}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             logging_level="ERROR", runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": _port()})
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        # Ray ends its actors without running their exit hooks: their pool files go now.
        time.sleep(0.5)
        sweep_stale(SHM_DIR)


def _generate(group, rid, prompt, n=10):
    req = {"request_id": rid, "prompt_token_ids": prompt,
           "sampling": {"max_tokens": n, "temperature": 0, "ignore_eos": True}}
    return [t for out in group.options(stream=True).generate.remote(req, None) for t in out["new_token_ids"]]


def _drained(group, bound_s=20):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        stats = group.stats.remote().result()
        if all(s["running"] == 0 and s["kv_blocks_used"] == 0 and s["awaiting_kv"] == 0
               and s["quarantined_blocks"] == 0 for s in stats):
            return stats
        time.sleep(0.2)
    raise AssertionError(f"KV pools not empty after {bound_s} s: {stats}")


def test_ipc_pd_equals_decode_alone_and_moves_exact_bytes(cluster, tiny_ckpt):
    group = _deploy(tiny_ckpt, timeout_s=20)
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    bs = ENGINE["block_size"]
    kv = alone.runner.kv
    block_bytes = sum(t.shape[0] * bs * t[0, 0].numel() * t.element_size()
                      for t in (kv.global_kv, getattr(kv, "kv_scale", None), kv.index_keys) if t is not None)

    prompt = list(range(20, 61))  # 41 tokens: 11 blocks, the last one partial
    out1 = _generate(group, "one", prompt)
    assert out1 == alone.generate([prompt], greedy)[0].output_token_ids
    [s] = group.stats.remote().result()
    assert s["kv_transport"] == "ipc"
    assert s["prefill_remote"] == 1 and s["prefill_fallback"] == 0
    assert s["kv_transfers_ipc"] == 1 and s["kv_transfers_nixl"] == 0
    assert s["kv_bytes_received"] == 11 * block_bytes

    # The next turn: decode has the first turn's full blocks cached, so only the rest moves.
    turn2 = prompt + out1 + list(range(100, 120))
    assert _generate(group, "two", turn2) == alone.generate([turn2], greedy)[0].output_token_ids
    [s2] = group.stats.remote().result()
    assert s2["kv_transfers_ipc"] == 2 and s2["prefill_fallback"] == 0
    moved = s2["kv_bytes_received"] - s["kv_bytes_received"]
    assert 0 < moved <= (-(-len(turn2) // bs) - 10) * block_bytes and moved % block_bytes == 0

    prefill = serve.get_deployment_handle("PrefillServer", app_name="wideep").stats.remote().result()
    assert prefill["kv_transport"] == "ipc" and prefill["kv_transfers_ipc"] == 2 and prefill["held_kv"] == 0
    _drained(group)


def test_ipc_transfer_past_its_limit_recomputes_and_leaks_nothing(cluster, tiny_ckpt):
    group = _deploy(tiny_ckpt, timeout_s=0.001)
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for i in range(3):
        prompt = list(range(30 + i, 70 + i))
        assert _generate(group, f"late{i}", prompt) == alone.generate([prompt], greedy)[0].output_token_ids
    [s] = group.stats.remote().result()
    assert s["prefill_fallback"] == 3 and s["prefill_remote"] == 0 and s["kv_transfers_ipc"] == 0
    _drained(group)  # the reservations a late write may still land in came back after their grace


def test_auto_on_cpu_moves_kv_over_nixl(cluster, tiny_ckpt):
    """'auto' offers IPC on CUDA only (a CPU pool would have to live in /dev/shm): here NIXL moves it."""
    group = _deploy(tiny_ckpt, timeout_s=20, backend="auto")
    alone = LLMEngine.from_pretrained(tiny_ckpt, EngineConfig(**ENGINE), progress=False)
    prompt = list(range(40, 75))
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    assert _generate(group, "auto", prompt) == alone.generate([prompt], greedy)[0].output_token_ids
    [s] = group.stats.remote().result()
    assert s["kv_transport"] == "auto" and s["prefill_remote"] == 1
    assert s["kv_transfers_nixl"] == 1 and s["kv_transfers_ipc"] == 0 and s["kv_bytes_received"] > 0
    _drained(group)
