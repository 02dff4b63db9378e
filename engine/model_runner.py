"""Owns the model and its KV memory; turns a scheduled batch into one forward and samples."""
from __future__ import annotations

from contextvars import ContextVar

import torch

from .attention import AttentionContext, build_masks
from .config import EngineConfig
from .model import DeepseekForCausalLM
from .sampling import Sampler
from .scheduler import ScheduledBatch


# Set around engine construction by a transport that needs the KV pool in memory another
# process can map (engine/kv_ipc.py); unset, the pool is ordinary tensors.
KV_POOL_ALLOCATOR: ContextVar = ContextVar("kv_pool_allocator", default=None)


class KVCache:
    """Global latent KV (one entry per KV-source layer and token slot), the indexer's keys
    beside it, and each running sequence's window-KV ring for every layer."""

    def __init__(self, model: DeepseekForCausalLM, cfg: EngineConfig, device, dtype, alloc=None):
        mc = model.cfg
        slots = cfg.num_blocks * cfg.block_size
        n_src = len(mc.source_layers)
        self.global_kv = torch.zeros(n_src, slots, mc.latent_dim, device=device, dtype=dtype)
        self.index_keys = (torch.zeros(n_src, slots, mc.index_head_dim, device=device, dtype=dtype)
                           if mc.index_topk else None)
        self.window = mc.sliding_window
        if self.window:
            self.window_kv = torch.zeros(cfg.max_num_seqs, mc.num_hidden_layers, self.window, mc.latent_dim,
                                         device=device, dtype=dtype)
            self.window_pos = torch.full((cfg.max_num_seqs, self.window), -1, dtype=torch.long, device=device)

        # alloc(name, tensor) -> the same contents in memory of its choosing; only the pool
        # tensors that move between engines go through it (the window KV never moves).
        alloc = alloc or KV_POOL_ALLOCATOR.get()
        if alloc is not None:
            for name in ("global_kv", "kv_scale", "index_keys"):
                if getattr(self, name, None) is not None:
                    setattr(self, name, alloc(name, getattr(self, name)))

    def nbytes(self) -> int:
        tensors = [self.global_kv, self.index_keys] + ([self.window_kv] if self.window else [])
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.kv = KVCache(model, cfg, self.device, self.dtype)
        self.sampler = Sampler()

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionContext, list[int]]:
        bs = self.cfg.block_size
        ids, positions, write_rows, write_slots, logit_rows = [], [], [], [], []
        starts, ctx_lens = [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            ids.extend(seq.token_slice(start, start + n))
            for p in range(start, start + n):
                if p >= seq.num_cached_tokens:  # replayed positions keep their cached global KV
                    write_rows.append(len(positions))
                    write_slots.append(seq.block_table[p // bs] * bs + p % bs)
                positions.append(p)
            starts.append(start)
            ctx_lens.append(start + n)
            if start + n == seq.num_tokens:
                logit_rows.append(len(ids) - 1)
        b, n_max, c_max = len(batch), max(batch.num_tokens), max(ctx_lens)
        q_index = torch.zeros(b, n_max, dtype=torch.long)
        q_pos = torch.full((b, n_max), -1, dtype=torch.long)
        q_flat = []
        row = 0
        for i, n in enumerate(batch.num_tokens):
            q_index[i, :n] = torch.arange(row, row + n)
            q_pos[i, :n] = torch.arange(starts[i], starts[i] + n)
            q_flat.extend(range(i * n_max, i * n_max + n))
            row += n
        self.model.model.rotary.ensure(c_max)
        max_blocks = -(-c_max // bs)
        tables = torch.zeros(b, max_blocks, dtype=torch.long)
        for i, seq in enumerate(batch.seqs):
            t = seq.block_table[:max_blocks]
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        j = torch.arange(c_max)
        key_slots = tables[:, j // bs] * bs + j % bs

        dev = self.device
        q_index, q_pos, key_slots = q_index.to(dev), q_pos.to(dev), key_slots.to(dev)
        context_lens = self._tensor(ctx_lens)
        positions = self._tensor(positions)
        ctx = AttentionContext(
            positions=positions, rope=self.model.model.rotary.tables(positions), write_rows=self._tensor(write_rows),
            write_slots=self._tensor(write_slots), q_index=q_index, q_flat=self._tensor(q_flat), q_pos=q_pos,
            key_slots=key_slots, g_mask=None,
            global_kv=self.kv.global_kv, index_keys=self.kv.index_keys)
        ring_pos = None
        if self.kv.window:
            for s in batch.new_window_slots:
                self.kv.window_pos[s] = -1
            w = self.kv.window
            win_slots = [seq.window_slot for seq in batch.seqs]
            ctx.window_kv = self.kv.window_kv
            ctx.window_slots = self._tensor(win_slots)
            ring_pos = self.kv.window_pos[ctx.window_slots]
            ctx.ring_pos = ring_pos
            # Only the last W positions of each sequence stay in its ring after this step.
            rows, wslot, widx = [], [], []
            r = 0
            for i, n in enumerate(batch.num_tokens):
                for k in range(n):
                    p = starts[i] + k
                    if p >= ctx_lens[i] - w:
                        rows.append(r)
                        wslot.append(win_slots[i])
                        widx.append(p % w)
                    r += 1
            ctx.win_write_rows, ctx.win_write_slot, ctx.win_write_idx = (
                self._tensor(rows), self._tensor(wslot), self._tensor(widx))
        ctx.g_mask, ctx.w_mask = build_masks(q_pos, context_lens, c_max, self.kv.window, ring_pos)
        return self._tensor(ids), ctx, logit_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """One forward over the batch. Returns the indices (into the batch) of the sequences
        whose last known token was computed, and their next-token logits."""
        input_ids, ctx, logit_rows = self.prepare(batch)
        hidden = self.model(input_ids, ctx)
        if self.kv.window:
            self.kv.window_pos[ctx.win_write_slot, ctx.win_write_idx] = ctx.positions[ctx.win_write_rows]
        done = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        return done, (self.model.compute_logits(hidden[logit_rows]) if done else None)

    @torch.inference_mode()
    def run_idle(self) -> None:
        """A forward with no tokens: only the MoE layers' collectives, in the same order as a
        real forward (expert parallelism)."""
        empty = torch.empty(0, self.model.cfg.hidden_size, device=self.device, dtype=self.dtype)
        for moe in self.model.moe_layers():
            moe(empty)

    def sample(self, seqs, logits: torch.Tensor) -> list[int]:
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
