"""MLA attention over the paged global latent KV and the per-layer window KV.

Everything is computed in the absorbed form: queries are mapped into the latent space
(q_nope @ W_UK), scored against cached latents, and the weighted latent sum is mapped
back with W_UV. One path serves prefill chunks, decode and mixed batches: the batch
is padded to [B sequences, N query tokens, C context positions].

Which latent a key position j comes from, for a query at position p of layer l:
- the layer's own window KV if sliding_window is on, j > p - W, and the window holds j;
- otherwise the global latent KV of the latest KV-source layer at or before l.
With the V4.1 options off every layer is a source and this is exactly DeepSeek-V3.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from wideep_kernels.fp8_kv import dequantize_kv, quantize_kv

if TYPE_CHECKING:
    from .decode_attention import DecodeBatch

_NEG = -1e30  # finite, so rows with no valid key (padding) stay NaN-free


@dataclass
class AttentionContext:
    """Per-forward attention metadata, built once by the model runner and shared by all layers."""

    positions: torch.Tensor          # [T] position of each token
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, rope_dim/2] for those positions
    write_rows: torch.Tensor | None  # token rows whose global KV is written (replayed rows are already
                                     # cached); None: every row (a decode step), no gather
    write_slots: torch.Tensor        # their flat global-KV slots
    q_index: torch.Tensor            # [B, N] token row of each padded query (0 where padding)
    q_flat: torch.Tensor             # [T] where each token sits in the flattened [B*N] padding
    q_pos: torch.Tensor              # [B, N] query positions (-1 where padding)
    key_slots: torch.Tensor | None   # [B, C] flat global-KV slot of context position j
    g_mask: torch.Tensor | None      # [B, N, C] global keys visible to each query (window-covered ones removed)
    global_kv: torch.Tensor          # [num_sources, num_slots, latent_dim]; float8 when kv_scale is set
    index_keys: torch.Tensor | None  # [num_sources, num_slots, index_head_dim]
    kv_scale: torch.Tensor | None = None  # [num_sources, num_slots] per-token scales of an FP8 global KV
    index_scale: torch.Tensor | None = None  # the same for FP8 indexer keys
    decode: "DecodeBatch | None" = None   # set when every sequence decodes one token (the kernel path)
    compute_dtype: torch.dtype = torch.float32
    # window KV (None when sliding_window is off)
    window_kv: torch.Tensor | None = None      # [num_window_slots, num_layers, W, latent_dim]
    window_slots: torch.Tensor | None = None   # [B] window ring of each sequence
    ring_pos: torch.Tensor | None = None       # [B, W] positions held by each ring before this step
    w_mask: torch.Tensor | None = None         # [B, N, W + N]
    win_write_rows: torch.Tensor | None = None  # token rows whose window KV is kept after the step
    win_write_slot: torch.Tensor | None = None
    win_write_idx: torch.Tensor | None = None
    # The latest scoring layer's top-k (decode kernels: positions; padded path: the mask), which
    # layers that reuse a selection attend to (EngineConfig.index_topk_freq)
    shared_topk: torch.Tensor | None = None
    shared_g_mask: torch.Tensor | None = None
    _gathered: dict = field(default_factory=dict)

    def write_global(self, source: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        rows = latent if self.write_rows is None else latent[self.write_rows]
        if self.kv_scale is not None:
            rows, scale = quantize_kv(rows)
            self.kv_scale[source, self.write_slots] = scale
        self.global_kv[source, self.write_slots] = rows.to(self.global_kv.dtype)
        if index_key is not None:
            rows = index_key if self.write_rows is None else index_key[self.write_rows]
            if self.index_scale is not None:
                rows, scale = quantize_kv(rows)
                self.index_scale[source, self.write_slots] = scale
            self.index_keys[source, self.write_slots] = rows.to(self.index_keys.dtype)
        self._gathered.pop(source, None)

    def direct_write(self, source: int, index_key: torch.Tensor | None) -> tuple | None:
        """(slots, latent slab, index_key, index slab[, index scales]) for the latent kernel to
        write a decode step's global KV itself (wideep_kernels/latent.py, latent_and_query; it quantises
        FP8 index keys), or None where write_global must: some rows not written, an FP8 latent
        cache, no indexer key."""
        if self.write_rows is not None or self.kv_scale is not None or index_key is None or self.index_keys is None:
            return None
        self._gathered.pop(source, None)
        write = (self.write_slots, self.global_kv[source], index_key, self.index_keys[source])
        return write if self.index_scale is None else (*write, self.index_scale[source])

    def global_keys(self, source: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Latents [B, C, D] (and indexer keys) of a source layer; gathered once, reused by later layers."""
        if source not in self._gathered:
            lat = self.global_kv[source][self.key_slots]
            if self.kv_scale is not None:
                lat = dequantize_kv(lat, self.kv_scale[source][self.key_slots], self.compute_dtype)
            idx = self.index_keys[source][self.key_slots] if self.index_keys is not None else None
            if self.index_scale is not None:
                idx = dequantize_kv(idx, self.index_scale[source][self.key_slots], self.compute_dtype)
            self._gathered[source] = (lat, idx)
        return self._gathered[source]

    def global_slab(self, source: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One source layer's global KV [num_slots, D] and its FP8 scales (or None)."""
        return self.global_kv[source], (self.kv_scale[source] if self.kv_scale is not None else None)

    def window_keys(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """This layer's window latents: the ring from earlier steps, then this step's tokens."""
        ring = self.window_kv[self.window_slots, layer]  # [B, W, D]
        fresh = latent[self.q_index]                      # [B, N, D]
        return torch.cat([ring.to(fresh.dtype), fresh], dim=1)

    def write_window(self, layer: int, latent: torch.Tensor) -> None:
        if self.win_write_rows.numel():
            self.window_kv[self.win_write_slot, layer, self.win_write_idx] = (
                latent[self.win_write_rows].to(self.window_kv.dtype))


def build_masks(q_pos: torch.Tensor, context_lens: torch.Tensor, num_ctx: int,
                window: int | None, ring_pos: torch.Tensor | None):
    """Visibility masks shared by all layers.

    Returns (g_mask [B,N,C], w_mask [B,N,W+N] or None). Padding queries (q_pos -1) see nothing.
    """
    j = torch.arange(num_ctx, device=q_pos.device)
    qp = q_pos[..., None]  # [B, N, 1]
    g_mask = (j <= qp) & (j < context_lens[:, None, None]) & (qp >= 0)
    if window is None:
        return g_mask, None
    w_pos = torch.cat([ring_pos, q_pos], dim=1)  # [B, W+N]
    wp = w_pos[:, None, :]
    w_mask = (wp >= 0) & (wp <= qp) & (wp > qp - window)
    # Positions the window holds are read from the window, not the global KV.
    held = torch.zeros(q_pos.shape[0], num_ctx + 1, dtype=torch.bool, device=q_pos.device)
    held.scatter_(1, torch.where(w_pos >= 0, w_pos, num_ctx).clamp(max=num_ctx), True)
    covered = held[:, None, :num_ctx] & (j > qp - window)
    return g_mask & ~covered, w_mask


def index_topk_mask(idx_q: torch.Tensor, idx_w: torch.Tensor, idx_keys: torch.Tensor,
                    g_mask: torch.Tensor, topk: int) -> torch.Tensor:
    """Keep only the top-k global keys per query by the indexer's score.

    idx_q [B,N,Hi,Di], idx_w [B,N,Hi], idx_keys [B,C,Di]. Score = sum_h w_h * relu(q_h . k).
    A query with at most k candidates keeps exactly its mask, so index_topk >= context is
    exactly dense attention.
    """
    num_ctx = g_mask.shape[-1]
    if topk >= num_ctx:
        return g_mask
    # A query with <= k candidates keeps them all: their scores are >= 0, the rest -inf.
    s = torch.einsum("bnhd,bcd->bnhc", idx_q.float(), idx_keys.float()).relu()
    s = (s * idx_w.float()[..., None]).sum(2)
    s = s.masked_fill(~g_mask, float("-inf"))
    # relu makes exact-zero ties common; break them towards recent positions, the same way
    # whatever the padding, so chunked and one-shot prefill choose the same entries.
    order = s.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :topk]
    chosen = num_ctx - 1 - order
    sel = torch.zeros_like(g_mask).scatter_(-1, chosen, True)
    return g_mask & sel


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, kv_lora: int) -> torch.Tensor:
    """q [B,N,H,D], keys [B,K,D], mask [B,N,K] -> latent output [B,N,H,kv_lora]."""
    b, n, h, d = q.shape
    s = torch.matmul(q.reshape(b, n * h, d), keys.transpose(1, 2).to(q.dtype)).float() * scale
    s = s.view(b, n, h, -1).masked_fill(~mask[:, :, None, :], _NEG)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    out = torch.matmul(p.view(b, n * h, -1), keys[..., :kv_lora].to(q.dtype))
    return out.view(b, n, h, kv_lora)
