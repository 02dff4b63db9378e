"""The Serve application on the GPUs of one host: prefill on one GPU, decode on another, the
prompt's KV pushed GPU to GPU. A smoke run with the tiny model (bf16), plus the KV
transport's GPU-to-GPU speed against a plain peer copy in the same run.

    python3 -m bench.gpu_serve_smoke
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import ray
import torch
from ray import serve

from app.main import build_app


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transport_vs_peer_copy(blocks: int = 2048) -> dict:
    """KVTransport (NIXL) cuda:0 -> cuda:1 in one process, against dst.copy_(src): a latent KV
    pool of 4 source layers x 16-token blocks x 576 bf16 values."""
    from engine.kv_transfer import KVTransport

    a = torch.randn(4, blocks * 16, 576, device="cuda:0", dtype=torch.bfloat16)
    b = torch.zeros(4, blocks * 16, 576, device="cuda:1", dtype=torch.bfloat16)
    nbytes = a.numel() * a.element_size()
    b.copy_(a)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    t0 = time.perf_counter()
    b.copy_(a)
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    peer = nbytes / (time.perf_counter() - t0) / 2**30
    src, dst = KVTransport("src", [a], 16), KVTransport("dst", [b], 16)
    peer_name = src.connect(dst.metadata())
    ids = list(range(blocks))
    src.wait(src.write_blocks(peer_name, ids, ids, b"warm"), 60)
    t0 = time.perf_counter()
    src.wait(src.write_blocks(peer_name, ids, ids, b"timed"), 120)
    nixl = nbytes / (time.perf_counter() - t0) / 2**30
    ok = bool(torch.equal(a.cpu(), b.cpu()))
    src.close(), dst.close()
    return {"bytes": nbytes, "peer_copy_GiB_s": round(peer, 1), "nixl_GiB_s": round(nixl, 2), "exact": ok}


def main():
    report = {"transport": transport_vs_peer_copy()}
    print(json.dumps(report), flush=True)
    port = _port()
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.perf_counter()
        serve.run(build_app({
            "model": {"preset": "tiny"}, "engine": {"dtype": "bfloat16", "block_size": 16},
            "prefill": {"replicas": 1, "devices": "cuda"}, "decode": {"dp_size": 1, "devices": "cuda"},
            "kv_transport": {"backend": "nixl", "local_prefill_max_tokens": 0, "timeout_s": 30},
            "placement": {"ingress_cpus": 1}}), name="wideep", route_prefix="/", blocking=False)
        report["ready_s"] = round(time.perf_counter() - t0, 1)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        texts = []
        for i in range(3):
            r = httpx.post(url, timeout=120, json={"messages": [{"role": "user", "content": "hello " * (50 + i)}],
                                                   "max_tokens": 16, "temperature": 0})
            texts.append((r.status_code, r.json().get("usage")))
        stats = serve.get_deployment_handle("DecodeGroup", app_name="wideep").stats.remote().result()
        report.update(requests=texts, prefill_remote=stats[0]["prefill_remote"],
                      prefill_fallback=stats[0]["prefill_fallback"], kv_bytes=stats[0]["kv_bytes_received"])
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
