"""RMSNorm and rotary-embedding kernels vs the torch expressions of engine/layers.py.

Sizes of the `bench` model (bf16): norms over hidden 2048, q_lora 768 and kv_lora 512 (the
last a strided slice of the [T, 576] latent projection, as in the engine); rope on the
[T, 16, 64] rope slice of q [T, 16, 192] and on the [T, 64] rope tail of the latent projection,
interleaved pairs (DeepSeek's layout). The `layer` row runs one decode layer's worth together:
four norms (input, q_a, kv_a, post-attention) and the two ropes. Each row also checks the
kernel's output against the reference.

eager columns time one call from the host (launch overhead included: what an eager decode
step pays); graph columns replay a CUDA graph of one call (GPU time only: what a graph-captured
decode step pays, and where the fewer kernels show). Median of the iterations, CUDA events.

    python -m bench.kernel_norm_rope --device cuda --json bench/out/kernel_norm_rope.json
    python -m bench.kernel_norm_rope --device cpu --quick      # TRITON_INTERPRET=1 smoke
"""
from __future__ import annotations

import os

import torch

from bench.kernel_timing import bench_main, graph_ms, time_ms

HIDDEN, Q_LORA, KV_LORA, HEADS, NOPE, ROPE = 2048, 768, 512, 16, 128, 64
EPS = 1e-6


def _cases(t: int, device: str, dtype: torch.dtype) -> dict:
    """name -> (inputs of the reference and the kernel, extra kwargs), on fresh random data."""
    g = torch.Generator().manual_seed(t)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    weight = lambda d: (torch.rand(d, generator=g) + 0.5).to(dtype).to(device)  # noqa: E731
    latent = rnd(t, KV_LORA + ROPE)
    q = rnd(t, HEADS, NOPE + ROPE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE))
    pos = torch.randint(0, 100_000, (t,), generator=g).float()
    freqs = torch.outer(pos, inv_freq)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    return {
        f"rms_norm {HIDDEN}": ("norm", (rnd(t, HIDDEN), weight(HIDDEN), EPS)),
        f"rms_norm {Q_LORA}": ("norm", (rnd(t, Q_LORA), weight(Q_LORA), EPS)),
        f"rms_norm {KV_LORA} strided": ("norm", (latent[:, :KV_LORA], weight(KV_LORA), EPS)),
        f"rope q [T,{HEADS},{ROPE}] of {NOPE + ROPE}": ("rope", (q[..., NOPE:], cos, sin, True)),
        f"rope k [T,{ROPE}] of {KV_LORA + ROPE}": ("rope", (latent[:, KV_LORA:], cos, sin, True)),
    }


def _error(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = (out.float() - ref.float()).abs()
    return {"max_abs_err": float(diff.max()) if diff.numel() else 0.0,
            "equal": float((out == ref).float().mean()) if out.numel() else 1.0}


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels import triton
    from wideep_kernels.rmsnorm import rms_norm_reference, rms_norm_triton
    from wideep_kernels.rope import apply_rope_reference, apply_rope_triton

    fns = {"norm": (rms_norm_reference, rms_norm_triton), "rope": (apply_rope_reference, apply_rope_triton)}
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16
    token_counts = [1, 4] if quick else [16, 64, 256]
    warmup, iters = (1, 3) if quick else (10, 100)
    rows = []
    for t in token_counts:
        cases = _cases(t, device, dtype)
        for name, (kind, args) in cases.items():
            ref_fn, tri_fn = fns[kind]
            row = {"name": name, "T": t, **_error(tri_fn(*args), ref_fn(*args))}
            row.update(_timings(lambda: ref_fn(*args), lambda: tri_fn(*args), device, cuda, warmup, iters))
            rows.append(row)
        # One decode layer's norms and ropes (the hidden norm twice: input and post-attention).
        calls = [cases[f"rms_norm {HIDDEN}"]] * 2 + [c for n, c in cases.items() if n != f"rms_norm {HIDDEN}"]
        layer_ref = lambda: [fns[k][0](*a) for k, a in calls]  # noqa: E731
        layer_tri = lambda: [fns[k][1](*a) for k, a in calls]  # noqa: E731
        row = {"name": "layer: 4 norms + 2 ropes", "T": t}
        row.update(_timings(layer_ref, layer_tri, device, cuda, warmup, iters))
        rows.append(row)
    return rows


def _timings(ref_fn, tri_fn, device: str, cuda: bool, warmup: int, iters: int) -> dict:
    row = {"ref_ms": time_ms(ref_fn, device, warmup, iters),
           "triton_ms": time_ms(tri_fn, device, warmup, iters)}
    row["speedup"] = row["ref_ms"] / row["triton_ms"]
    if cuda:
        row["ref_graph_ms"] = graph_ms(ref_fn, warmup, iters)
        row["triton_graph_ms"] = graph_ms(tri_fn, warmup, iters)
        row["graph_speedup"] = row["ref_graph_ms"] / row["triton_graph_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__.splitlines()[0], argv=argv)


if __name__ == "__main__":
    main()
