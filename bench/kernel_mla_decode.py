"""Paged MLA decode attention: plain-torch reference vs the Triton flash-decoding kernel.

H=16 heads, latents of 512 + 64 (bf16, or FP8 E4M3 with a per-token scale), blocks of 64
slots scattered over one slab. Dense rows read every position of each sequence; sparse rows
read the 2048 positions an indexer would pick (random here). Both paths run on the same
inputs in the same process, and the kernel's output is compared with the reference's on
those inputs (`max_err`, and `rel_err` = max_err / max |reference|), so a fast wrong kernel
shows. `kv_GBps` = bytes of keys (and FP8 scales) the kernel must read / its time. The L2
cache is flushed before every timed call: a decode step never finds the KV of another layer
in cache. When the reference's intermediates do not fit, it runs on the first `ref_batch`
sequences and its time is scaled up per sequence for `speedup`.

    python -m bench.kernel_mla_decode --device cuda --json bench/results/kernel_mla_decode.json
    python -m bench.kernel_mla_decode --device cpu --quick     # interpreter smoke test
"""
from __future__ import annotations

import os

import torch

from bench.kernel_timing import bench_main, time_ms

HEADS, KV_LORA, ROPE, BLOCK = 16, 512, 64, 64
SM_SCALE = 192 ** -0.5  # DeepSeek's qk_head_dim = 128 + 64
KV_BUDGET = 40e9  # skip cases whose KV slab alone is larger


def make_inputs(batch: int, context: int, device: str, heads: int, kv_lora: int, rope: int,
                block_size: int, topk: int | None, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(batch, blocks_per_seq).to(torch.int32)
    d = kv_lora + rope
    kv = torch.randn(num_blocks * block_size, d, generator=gen, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, d, generator=gen, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    topk_pos = None
    if topk is not None:
        scores = torch.rand(batch, context, generator=gen, device=device)
        topk_pos = scores.topk(min(topk, context), dim=1).indices.to(torch.int32)
    return q, kv, tables, lens, topk_pos


def quantize_in_chunks(kv: torch.Tensor, rows: int = 1 << 20):
    """Per-token FP8 of a large slab without a full-size fp32 temporary."""
    from wideep_kernels.fp8_kv import FP8_DTYPE, quantize_kv
    q8 = torch.empty(kv.shape, dtype=FP8_DTYPE, device=kv.device)
    scale = torch.empty(kv.shape[0], dtype=torch.float32, device=kv.device)
    for i in range(0, kv.shape[0], rows):
        q8[i:i + rows], scale[i:i + rows] = quantize_kv(kv[i:i + rows])
    return q8, scale


def reference_batch_that_fits(batch: int, keys_per_seq: int, d: int, heads: int, device: str) -> int:
    """Largest batch (halving) whose reference intermediates fit in half the free memory."""
    if not device.startswith("cuda"):
        return batch
    free, _ = torch.cuda.mem_get_info()
    # gathered keys (raw + fp32 + fp32 dequantised + value slice), scores, probabilities
    per_seq = keys_per_seq * (d * 16 + heads * 12)
    b = batch
    while b > 1 and b * per_seq > free // 2:
        b //= 2
    return b


def cases(quick: bool):
    """(mode, batch, context, topk) in the order they run."""
    if quick:
        return [("dense", 1, 61, None), ("dense", 3, 200, None), ("topk", 2, 300, 32)]
    dense = [("dense", b, c, None) for c in (8192, 32768, 131072) for b in (1, 16, 64)]
    sparse = [("topk", 16, c, 2048) for c in (8192, 131072, 524288)]
    return dense + sparse


def run(device: str = "cuda", quick: bool = False) -> list[dict]:
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from wideep_kernels.mla_decode import mla_decode_reference, mla_decode_triton

    if quick:
        heads, kv_lora, rope, block_size, iters, warmup = 4, 32, 8, 4, 3, 1
    else:
        heads, kv_lora, rope, block_size, iters, warmup = HEADS, KV_LORA, ROPE, BLOCK, 20, 3
    d = kv_lora + rope
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.startswith("cuda") else None
    rows = []
    for mode, batch, context, topk in cases(quick):
        if batch * context * d * 2 > KV_BUDGET:
            continue
        q, kv_bf16, tables, lens, topk_pos = make_inputs(batch, context, device, heads, kv_lora, rope,
                                                         block_size, topk)
        keys_per_seq = context if topk_pos is None else topk_pos.shape[1]
        ref_b = reference_batch_that_fits(batch, keys_per_seq, d, heads, device)
        for kv_dtype in ("bf16", "fp8"):
            if kv_dtype == "fp8":
                kv, kv_scale = quantize_in_chunks(kv_bf16)
                del kv_bf16
            else:
                kv, kv_scale = kv_bf16, None
            args = (q, kv, kv_scale, tables, lens, block_size, SM_SCALE, kv_lora, topk_pos)
            sub = None if topk_pos is None else topk_pos[:ref_b]
            ref_args = (q[:ref_b], kv, kv_scale, tables[:ref_b], lens[:ref_b], block_size, SM_SCALE, kv_lora, sub)

            out = mla_decode_triton(*args)
            ref = mla_decode_reference(*ref_args)
            err = float((out[:ref_b].float() - ref.float()).abs().max())
            mag = float(ref.float().abs().max())
            del out, ref

            ref_ms = time_ms(lambda: mla_decode_reference(*ref_args), device, warmup, iters, flush)
            tri_ms = time_ms(lambda: mla_decode_triton(*args), device, warmup, iters, flush)
            row_bytes = d * kv.element_size() + (4 if kv_scale is not None else 0)
            rows.append({
                "name": "mla_decode", "mode": mode, "kv_dtype": kv_dtype, "batch": batch, "context": context,
                "topk": topk or 0, "heads": heads, "latent": f"{kv_lora}+{rope}", "block_size": block_size,
                "ref_ms": round(ref_ms, 4), "ref_batch": ref_b, "triton_ms": round(tri_ms, 4),
                "speedup": round(ref_ms * batch / ref_b / tri_ms, 3),
                "kv_GBps": round(batch * keys_per_seq * row_bytes / tri_ms / 1e6, 3),
                "max_err": err, "rel_err": err / max(mag, 1e-30),
            })
            del args, ref_args, kv, kv_scale
        del q, tables, lens, topk_pos
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


COLUMNS = ["mode", "kv_dtype", "batch", "context", "topk", "ref_ms", "ref_batch", "triton_ms", "speedup",
           "kv_GBps", "max_err", "rel_err"]


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__.splitlines()[0], COLUMNS, argv)


if __name__ == "__main__":
    main()
