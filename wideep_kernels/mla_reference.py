"""The plain-torch definition of paged MLA decode attention (wideep_kernels/mla_decode.py's reference
path and the kernels' test oracle): global keys from the paged latent slab, all or the top-k
positions, and the window keys, fp32 throughout."""
from __future__ import annotations

import torch

from wideep_kernels.fp8_kv import FP8_DTYPE


def mla_decode_reference(q, kv, kv_scale, block_tables, g_lens, block_size: int, sm_scale: float,
                         kv_lora: int, topk_pos=None, win_kv=None, win_valid=None, ring=None) -> torch.Tensor:
    """Plain-torch definition of mla_decode (fp32 math throughout). Returns [B, H, kv_lora] in q's dtype."""
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    if ring is not None:
        ring_kv, ring_slots, fresh, write_idx = ring
        num_fresh = 1 if win_valid is None else win_valid.shape[1] - ring_kv.shape[1]
        back = (torch.arange(fresh.shape[0], device=fresh.device)[:, None]
                - torch.arange(num_fresh, device=fresh.device)).clamp(min=0)
        win_kv = torch.cat([ring_kv[ring_slots].to(fresh.dtype), fresh[back]], dim=1)
        out = mla_decode_reference(q, kv, kv_scale, block_tables, g_lens, block_size, sm_scale, kv_lora,
                                   topk_pos, win_kv, win_valid)
        if write_idx is not None:
            ring_kv[ring_slots, write_idx] = fresh.to(ring_kv.dtype)
        return out
    b, h, d = q.shape
    dev = q.device
    # Positions past the block table's capacity are ignored, as in the kernel.
    g_lens = g_lens.to(dev).long().clamp(max=block_tables.shape[1] * block_size)
    if topk_pos is None:
        pos = torch.arange(block_tables.shape[1] * block_size, device=dev).expand(b, -1)
        valid = pos < g_lens[:, None]
    else:
        pos = topk_pos.long()
        valid = (pos >= 0) & (pos < g_lens[:, None])
    pos = torch.where(valid, pos, 0)
    slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
    # Table entries past a sequence's blocks may hold anything: never index with them.
    slots = torch.where(valid, slots, 0)
    keys = kv[slots].float()
    if kv.dtype == FP8_DTYPE:
        keys = keys * kv_scale.float()[slots][..., None]
    if win_kv is not None and win_kv.shape[1] > 0:
        wv = torch.ones(win_kv.shape[:2], dtype=torch.bool, device=dev) if win_valid is None else win_valid
        keys = torch.cat([keys, win_kv.float()], dim=1)
        valid = torch.cat([valid, wv.bool()], dim=1)
    s = torch.einsum("bhd,bkd->bhk", q.float(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), 0.0, m)  # a row with no key: exp(-inf) = 0 everywhere
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhk,bkc->bhc", p, keys[..., :kv_lora])
    out = torch.where(denom > 0, out / denom.clamp(min=1e-30), 0.0)
    return out.to(q.dtype)
