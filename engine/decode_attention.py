"""The kernel attention path: every query row attended on its own, keys read through block
tables by the paged kernels. Decode steps (one query per sequence) always take it; prefill
chunks take it with sparse attention, where a row reads at most index_topk + 2W keys.

A step in which every sequence decodes one token needs no [B, N, C] padding or masks: the
attention kernel walks each sequence's block table up to `g_lens` (global positions that
the window does not hold) and reads the window ring beside it; the indexer kernel picks
the top-k global positions without gathering the keys. Every tensor here is derived on the
device from a few index tensors, so a whole decode forward can be captured in a CUDA graph.

The window ring is complete at decode time: prefill, replay and recompute always compute
the last W positions on this engine before the first decode step. So the global keys a
query at position p sees are exactly positions 0 .. p-W, and the window holds p-W+1 .. p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from wideep_kernels.index_score_rows import RowGroups, prompt_row_groups
from wideep_kernels.indexer import indexer_topk
from wideep_kernels.mla_decode import mla_decode


@dataclass
class DecodeBatch:
    """Per-forward metadata of a decode step, shared by all layers."""

    block_tables: torch.Tensor          # [B, M] int32 blocks of each sequence
    g_lens: torch.Tensor                # [B] int32 global positions each query reads
    block_size: int
    sparse: bool                        # some sequence has more global positions than index_topk
    win_valid: torch.Tensor | None = None  # [B, W + 1] ring entries still in the window, then the fresh token
    # Prefill chunks (rows are tokens, several per sequence): each row's sequence, and the rows of
    # this step's latents that sit in its window (the row itself first).
    ring_rows: torch.Tensor | None = None    # [T] which sequence's window ring a row reads
    fresh_index: torch.Tensor | None = None  # [T, W]
    row_seqs: torch.Tensor | None = None     # [T] each row's sequence
    max_runs: int = 0                        # runs of one sequence's rows a step holds at most
    row_groups: RowGroups | None = None      # the indexer's groups of rows (made by its first layer)


def build_decode_batch(positions: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                       window: int | None, ring_pos: torch.Tensor | None, sparse: bool) -> DecodeBatch:
    """Device-only: positions [B] (position of each sequence's new token), ring_pos [B, W]
    (positions its window ring holds before this step, -1 where empty)."""
    if window is None:
        g_lens = positions + 1
        win_valid = None
    else:
        g_lens = (positions - window + 1).clamp(min=0)
        p = positions[:, None]
        ring_ok = (ring_pos >= 0) & (ring_pos > p - window) & (ring_pos < p)
        win_valid = torch.cat([ring_ok, torch.ones_like(ring_ok[:, :1])], dim=1)
    return DecodeBatch(block_tables=block_tables, g_lens=g_lens.to(torch.int32), block_size=block_size,
                       sparse=sparse, win_valid=win_valid)


def build_token_batch(positions: torch.Tensor, starts: torch.Tensor, seq_of: torch.Tensor,
                      tables: torch.Tensor, block_size: int, window: int | None,
                      ring_pos: torch.Tensor | None, sparse: bool) -> DecodeBatch:
    """Device-only metadata for any batch, one row per token: positions [T], starts [T] (first
    position computed this step for the row's sequence), seq_of [T], tables [B, M] int32,
    ring_pos [B, W]. Rows of a sequence are consecutive, in position order.

    A row at position p of a chunk starting at s holds in its window the ring's positions
    (all < s) and the chunk's positions s..p; those inside (p - W, p] are read from there and
    form a suffix [c, p] of the positions (the ring keeps a sequence's latest positions), so the
    global keys are exactly 0 .. c-1: g_len = p + 1 - (window entries)."""
    rows = seq_of.shape[0]
    block_tables = tables[seq_of]
    if window is None:
        return DecodeBatch(block_tables=block_tables, g_lens=(positions + 1).to(torch.int32),
                           block_size=block_size, sparse=sparse, row_seqs=seq_of, max_runs=tables.shape[0])
    p, s = positions[:, None], starts[:, None]
    ring = ring_pos[seq_of]
    ring_ok = (ring >= 0) & (ring > p - window) & (ring < s)
    back = torch.arange(window, device=positions.device)
    fresh_ok = (p - back) >= s
    fresh_index = (torch.arange(rows, device=positions.device)[:, None] - back).clamp(min=0)
    covered = ring_ok.sum(1) + fresh_ok.sum(1)
    return DecodeBatch(block_tables=block_tables, g_lens=(positions + 1 - covered).to(torch.int32),
                       block_size=block_size, sparse=sparse, win_valid=torch.cat([ring_ok, fresh_ok], dim=1),
                       ring_rows=seq_of, fresh_index=fresh_index, row_seqs=seq_of, max_runs=tables.shape[0])


def decode_topk(attn, idx_q: torch.Tensor | None, idx_w: torch.Tensor | None, ctx) -> torch.Tensor | None:
    """The indexer's top-k global positions of each row (idx_q [T, Hi, Di], idx_w [T, Hi] its
    queries and unscaled head weights), or None where attention reads every global position."""
    cfg, dec = attn.cfg, ctx.decode
    if attn.indexer is None or not dec.sparse:
        return None
    scale = ctx.index_scale[attn.source] if ctx.index_scale is not None else None
    if dec.row_seqs is not None and dec.row_groups is None:  # once a step, for every layer
        dec.row_groups = prompt_row_groups(dec.row_seqs, attn.indexer.n_heads, dec.max_runs)
    return indexer_topk(idx_q, idx_w, ctx.index_keys[attn.source], dec.block_tables, dec.g_lens,
                        dec.block_size, cfg.index_topk, key_scale=scale, w_scale=attn.indexer.n_heads ** -0.5,
                        row_groups=dec.row_groups)


def decode_attention(attn, q: tuple[torch.Tensor, torch.Tensor], topk_pos: torch.Tensor | None,
                     latent: torch.Tensor | None, ctx) -> torch.Tensor:
    """MLA over kernel rows. q = (q_lat [T, H, kv_lora], q_rope [T, H, rope]) the absorbed
    queries, topk_pos the indexer's choice (decode_topk) -> latent output [T, H, kv_lora]."""
    cfg, dec = attn.cfg, ctx.decode
    kv, kv_scale = ctx.global_slab(attn.source)
    win_kv = ring = None
    write_after = False
    if cfg.sliding_window is not None:
        if ctx.window_kv.dtype == latent.dtype and dec.fresh_index is None:
            # Decode: the kernel reads each sequence's ring in place and writes the new latent
            # into it (the entry it replaces, position p - W, is outside this step's windows).
            ring = (ctx.window_kv[:, attn.layer], ctx.window_slots, latent, ctx.win_write_idx)
        elif ctx.window_kv.dtype == latent.dtype:
            # Prompt chunks: each row reads its sequence's ring and the chunk's latents in place (a
            # gathered [rows, 2W, D] copy was most of a 2048-row step's time); the ring takes this
            # step's latents after the kernel has read it as it was.
            ring = (ctx.window_kv[:, attn.layer], ctx.window_slots[dec.ring_rows], latent, None)
            write_after = True
        else:
            ring_rows = ctx.window_kv[ctx.window_slots, attn.layer]  # a copy, read before this step's write
            if dec.fresh_index is None:
                win_kv = torch.cat([ring_rows.to(latent.dtype), latent[:, None]], dim=1)
            else:
                win_kv = torch.cat([ring_rows[dec.ring_rows].to(latent.dtype), latent[dec.fresh_index]], dim=1)
            ctx.write_window(attn.layer, latent)
    out = mla_decode(q, kv, kv_scale, dec.block_tables, dec.g_lens, dec.block_size, attn.scale,
                     cfg.kv_lora_rank, topk_pos=topk_pos, win_kv=win_kv,
                     win_valid=dec.win_valid, ring=ring)
    if write_after:
        ctx.write_window(attn.layer, latent)
    return out
