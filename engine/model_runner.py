"""Owns the model and its KV memory; turns a scheduled batch into one forward and samples."""
from __future__ import annotations

from contextvars import ContextVar

import numpy as np
import torch

from wideep_kernels.token_mask import apply_token_mask

from .attention import AttentionContext, build_masks
from .cuda_graphs import DecodeGraphs
from .decode_attention import build_decode_batch, build_token_batch
from .ep_step import run_lockstep
from .config import ConfigError, EngineConfig
from .model import DeepseekForCausalLM
from .moe import MoE, expert_fp8_block
from .logprobs import prompt_logprob_rows, prompt_token_logprobs
from .penalties import TokenCounts, adjust_logits
from .sampling import Sampler, host_to_device
from .scheduler import ScheduledBatch
from .structured import fill_masks


# Set around engine construction by a transport that needs the KV pool in memory another
# process can map (engine/kv_ipc.py); unset, the pool is ordinary tensors.
KV_POOL_ALLOCATOR: ContextVar = ContextVar("kv_pool_allocator", default=None)


def _table_array(seq) -> np.ndarray:
    """The sequence's block table as int32, converted once and then extended as it grows: at long
    context a table has thousands of entries, and rebuilding each one every step costs more
    than the GPU's decode step. A block table only grows, or is replaced by a new list."""
    table, cached = seq.block_table, seq.table_cache
    if cached is None or cached[0] is not table or len(cached[1]) > len(table):
        arr = np.asarray(table, dtype=np.int32)
    elif len(cached[1]) < len(table):
        arr = np.concatenate([cached[1], np.asarray(table[len(cached[1]):], dtype=np.int32)])
    else:
        return cached[1]
    seq.table_cache = (table, arr)
    return arr


class KVCache:
    """Global latent KV (one entry per KV-source layer and token slot), the indexer's keys
    beside it, and each running sequence's window-KV ring for every layer."""

    def __init__(self, model: DeepseekForCausalLM, cfg: EngineConfig, device, dtype, alloc=None):
        mc = model.cfg
        # One block and one window ring more than the pool: padding rows of a CUDA-graph batch
        # write there, never into a live sequence's KV.
        slots = (cfg.num_blocks + 1) * cfg.block_size
        self.scratch_slot, self.scratch_window = cfg.num_blocks * cfg.block_size, cfg.max_num_seqs
        n_src = len(mc.source_layers)
        fp8 = cfg.kv_cache_dtype == "fp8_e4m3"
        self.global_kv = torch.zeros(n_src, slots, mc.latent_dim, device=device,
                                     dtype=torch.float8_e4m3fn if fp8 else dtype)
        self.kv_scale = torch.ones(n_src, slots, device=device, dtype=torch.float32) if fp8 else None
        # The indexer's keys follow the latent KV unless index_cache_dtype says otherwise: at long
        # context scoring them is the largest read.
        index_fp8 = cfg.index_fp8
        self.index_keys = (torch.zeros(n_src, slots, mc.index_head_dim, device=device,
                                       dtype=torch.float8_e4m3fn if index_fp8 else dtype)
                           if mc.index_topk else None)
        self.index_scale = (torch.ones(n_src, slots, device=device, dtype=torch.float32)
                            if index_fp8 and mc.index_topk else None)
        self.window = mc.sliding_window
        if self.window:
            self.window_kv = torch.zeros(cfg.max_num_seqs + 1, mc.num_hidden_layers, self.window, mc.latent_dim,
                                         device=device, dtype=dtype)
            self.window_pos = torch.full((cfg.max_num_seqs + 1, self.window), -1, dtype=torch.long, device=device)

        # alloc(name, tensor) -> the same contents in memory of its choosing; only the pool
        # tensors that move between engines go through it (the window KV never moves).
        alloc = alloc or KV_POOL_ALLOCATOR.get()
        if alloc is not None:
            for name in ("global_kv", "kv_scale", "index_keys", "index_scale"):
                if getattr(self, name, None) is not None:
                    setattr(self, name, alloc(name, getattr(self, name)))

    def nbytes(self) -> int:
        tensors = [self.global_kv, self.kv_scale, self.index_keys, self.index_scale] + (
            [self.window_kv] if self.window else [])
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expert_activations(cfg: EngineConfig, fp8_block: tuple[int, int] | None) -> str:
    """MoE.activations for EngineConfig.expert_activations beside experts of these FP8 blocks (None:
    16-bit experts): 'auto' stays 'auto' (FP8 where it pays, MoE.act_fp8) where the blocks allow it."""
    wanted = cfg.expert_activations
    if wanted == "fp8_e4m3" and fp8_block is None:
        raise ConfigError("expert_activations 'fp8_e4m3' multiplies FP8 weights, and expert_dtype "
                          f"{cfg.expert_dtype!r} keeps this model's experts 16-bit: set expert_dtype 'fp8_e4m3'")
    if fp8_block is not None and fp8_block[1] < 32:  # an FP8 tensor-core product takes 32 k a step
        if wanted == "fp8_e4m3":
            raise ConfigError(f"expert_activations 'fp8_e4m3': the experts' FP8 blocks {list(fp8_block)} need at "
                              "least 32 columns (an FP8 tensor-core product takes 32 a step)")
        return "model"
    if fp8_block is None or wanted == "model":
        return "model"
    return wanted


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cfg: EngineConfig):
        self.model, self.cfg = model, cfg
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.kv = KVCache(model, cfg, self.device, self.dtype)
        fp8_block = expert_fp8_block(model.cfg) if cfg.fp8_experts(model.cfg) else None
        activations = expert_activations(cfg, fp8_block)
        for moe in model.moe_layers():
            moe.gemm = cfg.moe_gemm
            moe.fuse_shared = cfg.fuse_shared_experts
            moe.activations = activations
            if fp8_block is not None and moe.fp8_block is None:
                moe.quantize_experts(fp8_block)
        self.set_overlap(cfg.decode_overlap)
        for layer, scores in zip(model.model.layers, cfg.index_scoring_layers(model.cfg)):
            layer.self_attn.reuse_topk = not scores
        self.sampler = Sampler()
        self.token_counts: TokenCounts | None = None  # made when a penalized request first samples
        self.eos_token_id: int | None = None  # the tokenizer's, set by the engine
        # The last eager step's prompt log-probabilities, for the engine to take:
        # ([(sequence, records)], target tokens, their token_logprobs() rows on the device).
        self.prompt_records: tuple | None = None
        self.graphs = (DecodeGraphs(self, cfg.cuda_graph_max_batch)
                       if cfg.cuda_graphs and self.device.type == "cuda" else None)
        self.ep = None  # engine.ep.ExpertParallel: this runner is one rank of a lockstep group

    def set_overlap(self, on: bool) -> None:
        """Side-stream branches in decode graphs captured from now on (engine/streams.py)."""
        for layer in self.model.model.layers:
            layer.self_attn.overlap = on
            if isinstance(layer.mlp, MoE):
                layer.mlp.overlap = on

    def attach_ep(self, ep) -> None:
        """Expert parallelism attaches after construction: every forward then starts with the
        group's agreement on its shape (engine/ep_step.py)."""
        self.ep = ep
        if self.graphs is not None:
            ep.reserve(max(self.graphs.sizes[-1], self.graphs.chunk_sizes[-1]))

    def _tensor(self, data, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def decode_length(self, batch: ScheduledBatch) -> int:
        """Tokens of the longest sequence when every sequence computes exactly its last token,
        which is not a cached position (a decode step); 0 otherwise. One pass: the host's time
        here is on the critical path of every step."""
        if not self.cfg.decode_kernels:
            return 0
        longest = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            total, computed = len(seq.prompt_ids) + len(seq.output_ids), seq.num_computed_tokens
            if n != 1 or computed + 1 != total or computed < seq.num_cached_tokens:
                return 0
            longest = total if total > longest else longest
        return longest

    def is_decode(self, batch: ScheduledBatch) -> bool:
        """Every sequence computes exactly its last token, which is not a cached position."""
        return self.decode_length(batch) > 0

    @staticmethod
    def decode_input_bytes(rows: int, width: int) -> tuple[int, int]:
        """Layout of a decode step's index tensors in one buffer: four int64 rows (ids, positions,
        write slots, window slots), then the int32 block tables [rows, width]. Rows padded to an
        even count keep every view 16-byte aligned, as kernels' builds assume. Returns (bytes of
        the int64 part, total bytes)."""
        head = 4 * (rows + rows % 2) * 8
        return head, head + rows * width * 4

    @classmethod
    def decode_input_views(cls, buf: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, write slots, block tables, window slots) as views of a uint8 buffer."""
        head, total = cls.decode_input_bytes(rows, width)
        ids, pos, slots, wslots = buf[:head].view(torch.int64).view(4, -1)[:, :rows]
        return ids, pos, slots, buf[head:total].view(torch.int32).view(rows, width), wslots

    def decode_width(self, batch: ScheduledBatch, longest: int | None = None) -> int:
        """Block-table entries the longest sequence of a decode step needs (`longest`: its
        tokens, when the caller has them)."""
        longest = longest or max(seq.num_tokens for seq in batch.seqs)
        return (longest - 1) // self.cfg.block_size + 1

    def fill_decode_inputs(self, batch: ScheduledBatch, host: np.ndarray, rows: int, width: int,
                           ahead: int = 0) -> bool:
        """Write a decode step's index tensors into `host` (uint8, laid out as decode_input_bytes
        says, any content) and return whether any sequence needs the sparse (indexer) path.
        Padded rows write to the scratch slot and ring and read block 0. ahead=1: each sequence's
        input token is still on the device (run_ahead), one past its last known token; its id
        here is 0."""
        bs = self.cfg.block_size
        head, total = self.decode_input_bytes(rows, width)
        host[:total] = 0
        ids, pos, slots, wslots = host[:head].view(np.int64).reshape(4, -1)[:, :rows]
        tables = host[head:total].view(np.int32).reshape(rows, width)
        slots[:] = self.kv.scratch_slot
        wslots[:] = self.kv.scratch_window
        # Python lists first, one store per row of the buffer: numpy's per-element stores cost
        # more than the rest of the loop (the host is on the critical path of every step).
        last, where, write, ring = [], [], [], []
        for i, seq in enumerate(batch.seqs):
            out = seq.output_ids
            p = len(seq.prompt_ids) + len(out) - 1 + ahead
            last.append(0 if ahead else out[-1] if out else seq.prompt_ids[-1])
            where.append(p)
            write.append(seq.block_table[p // bs] * bs + p % bs)
            t = _table_array(seq)[:width]
            tables[i, :len(t)] = t
            ring.append(self.kv.scratch_window if seq.window_slot is None else seq.window_slot)
        n = len(last)
        ids[:n], pos[:n], slots[:n], wslots[:n] = last, where, write, ring
        return self.needs_sparse(max(where, default=0) + 1)

    def needs_sparse(self, longest: int) -> bool:
        """Whether a decode step whose longest sequence has this many tokens takes the indexer's
        path: its global KV (all but the window's positions) outgrows index_topk."""
        mc = self.model.cfg
        return bool(mc.index_topk) and longest - (mc.sliding_window - 1 if mc.sliding_window else 0) > mc.index_topk

    def decode_inputs(self, batch: ScheduledBatch, pad_batch: int | None = None, pad_blocks: int | None = None,
                      ahead: int = 0):
        """Index tensors of a decode step on the device (one host-to-device copy): token ids,
        positions, KV write slots, block tables, window rings, and whether any sequence needs
        the sparse (indexer) path. Padded rows write to the scratch slot and ring."""
        longest = max(seq.num_tokens for seq in batch.seqs) + ahead
        rows, width = pad_batch or len(batch), pad_blocks or self.decode_width(batch, longest)
        host = np.empty(self.decode_input_bytes(rows, width)[1], dtype=np.uint8)
        sparse = self.fill_decode_inputs(batch, host, rows, width, ahead)
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        return (*self.decode_input_views(dev, rows, width), sparse)

    def chunk_rows(self, batch: ScheduledBatch) -> int:
        """Tokens of a step that is not a decode step, when the chunk graphs take it (a kernel row
        per token, CUDA graphs): at most cuda_graph_max_chunk of them. 0 otherwise."""
        if self.ep is not None:  # a lockstep group picks its chunk graphs together (engine/ep_step.py)
            return 0
        if self.wants_prompt_rows(batch):
            return 0
        total = sum(batch.num_tokens)
        return total if self.chunk_graphs_take(total) else 0

    @staticmethod
    def wants_prompt_rows(batch: ScheduledBatch) -> bool:
        """Whether a sequence of the step needs the logits of its prompt rows (prompt logprobs),
        which only the eager forward keeps: a chunk graph computes the due rows' alone."""
        return any(seq.needs_prompt_logprobs for seq in batch.seqs)

    def chunk_graphs_take(self, rows: int) -> bool:
        """Whether a chunk graph can take a step of this many tokens."""
        return self.graphs is not None and self.cfg.decode_kernels and self.graphs.covers_chunk(rows)

    def chunk_logit_rows(self, rows: int) -> int:
        """Rows of a chunk step's logits: one per sequence whose next token is due, at most
        max_num_seqs of them, however many tokens the step has."""
        return min(rows, self.cfg.max_num_seqs)

    def chunk_input_bytes(self, rows: int, width: int) -> tuple[int, int]:
        """Layout of a chunk step's index tensors: seven int64 rows (ids, positions, write slots,
        window slots by sequence, chunk starts, each row's sequence, each row's window-ring write
        slot), the int64 rows whose logits are due (chunk_logit_rows of them), then the int32
        block tables [rows, width] by sequence (at most one sequence per row)."""
        n = self.chunk_logit_rows(rows)
        head = (7 * (rows + rows % 2) + n + n % 2) * 8
        return head, head + rows * width * 4

    def chunk_input_views(self, buf: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions, write slots, block tables, window slots, starts, sequence of each row,
        ring write slot of each row, rows whose logits are due)."""
        head, total = self.chunk_input_bytes(rows, width)
        longs = buf[:head].view(torch.int64)
        r7 = 7 * (rows + rows % 2)
        ids, pos, slots, wslots, starts, seq_of, ring_write = longs[:r7].view(7, -1)[:, :rows]
        due = longs[r7:r7 + self.chunk_logit_rows(rows)]
        table = buf[head:total].view(torch.int32).view(rows, width)
        return ids, pos, slots, table, wslots, starts, seq_of, ring_write, due

    def fill_chunk_inputs(self, batch: ScheduledBatch, host: np.ndarray, rows: int, width: int,
                          ahead: int = 0) -> tuple[bool, list[int]]:
        """Write a chunk step's index tensors into `host` (laid out as chunk_input_bytes says);
        returns whether any row needs the sparse (indexer) path and the rows whose next token is
        due. Positions whose KV the prefix cache holds (a replayed window) write to the scratch
        slot; padded rows too, and they belong to a last, empty sequence. Only a sequence's last W
        positions of the step go into its window ring (rows of a chunk longer than the ring would
        collide there); earlier rows, and padded ones, write to the scratch ring. ahead=1: a decode
        step launched ahead (run_ahead), whose input tokens are still on the device: id 0 here."""
        bs, mc, w = self.cfg.block_size, self.model.cfg, self.kv.window
        head, total = self.chunk_input_bytes(rows, width)
        host[:total] = 0
        longs, r7 = host[:head].view(np.int64), 7 * (rows + rows % 2)
        ids, pos, slots, wslots, starts, seq_of, ring_write = longs[:r7].reshape(7, -1)[:, :rows]
        tables = host[head:total].view(np.int32).reshape(rows, width)
        slots[:] = self.kv.scratch_slot
        wslots[:] = ring_write[:] = self.kv.scratch_window
        seq_of[:] = rows - 1
        r, logit_rows, p_max = 0, [], 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, table = seq.num_computed_tokens, seq.block_table
            ids[r:r + n] = 0 if ahead else seq.token_slice(start, start + n)
            pos[r:r + n] = range(start, start + n)
            slots[r:r + n] = [table[p // bs] * bs + p % bs if p >= seq.num_cached_tokens else self.kv.scratch_slot
                              for p in range(start, start + n)]
            starts[r:r + n] = start
            seq_of[r:r + n] = i
            if seq.window_slot is not None:
                wslots[i] = seq.window_slot
                ring_write[r + max(0, n - w):r + n] = seq.window_slot
            t = _table_array(seq)[:width]
            tables[i, :len(t)] = t
            r += n
            p_max = max(p_max, start + n - 1)
            if start + n == seq.num_tokens + ahead:
                logit_rows.append(r - 1)
        if len(logit_rows) > self.chunk_logit_rows(rows):
            raise ValueError(f"{len(logit_rows)} sequences due in a step; the engine runs {self.cfg.max_num_seqs} "
                             f"at most (max_num_seqs)")
        longs[r7:r7 + len(logit_rows)] = logit_rows
        g_max = p_max + 1 - (mc.sliding_window - 1 if mc.sliding_window else 0)
        return bool(mc.index_topk) and g_max > mc.index_topk, logit_rows

    def chunk_forward(self, input_ids, positions, write_slots, block_tables, window_slots, starts, seq_of,
                      ring_write, due, sparse, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """A step with a kernel row per token (capturable): prompt chunks, their rows of a
        sequence consecutive and in position order, as build_token_batch reads them -> logits of
        the rows `due` names (its padding names row 0). The LM head runs on those rows alone: on
        every row, each graph would keep [rows, vocab] logits (265 MB at 512 rows of a 129K
        vocabulary, for each block-table width captured), most of them never read. logits_out: as
        in decode_forward."""
        ctx = AttentionContext(
            positions=positions, rope=self.model.model.rotary.tables(positions), write_rows=None,
            write_slots=write_slots, q_index=None, q_flat=None, q_pos=None, key_slots=None, g_mask=None,
            global_kv=self.kv.global_kv, index_keys=self.kv.index_keys, kv_scale=self.kv.kv_scale,
            index_scale=self.kv.index_scale, compute_dtype=self.dtype)
        ring_pos = None
        if self.kv.window:
            ctx.window_kv, ctx.window_slots = self.kv.window_kv, window_slots
            ring_pos = self.kv.window_pos[window_slots]
            ctx.win_write_rows = torch.arange(positions.shape[0], device=positions.device)
            ctx.win_write_slot, ctx.win_write_idx = ring_write, positions % self.kv.window
        ctx.decode = build_token_batch(positions, starts, seq_of, block_tables, self.cfg.block_size, self.kv.window,
                                       ring_pos, sparse)
        hidden = self.model(input_ids, ctx)
        if self.kv.window:
            self.kv.window_pos[ctx.win_write_slot, ctx.win_write_idx] = positions
        return self.model.compute_logits(hidden.index_select(0, due), logits_out)

    def window_snapshot(self, batch: ScheduledBatch):
        """The window rings and positions of the batch's sequences as they are now; returns a
        function that puts them back."""
        slots = sorted({seq.window_slot for seq in batch.seqs if seq.window_slot is not None})
        if not self.kv.window or not slots:
            return lambda: None
        idx = torch.tensor(slots, device=self.device)
        pos, ring = self.kv.window_pos[idx].clone(), self.kv.window_kv[idx].clone()

        def restore():
            self.kv.window_pos[idx] = pos
            self.kv.window_kv[idx] = ring
        return restore

    def decode_context(self, positions: torch.Tensor, write_slots: torch.Tensor, block_tables: torch.Tensor,
                       window_slots: torch.Tensor, sparse: bool) -> AttentionContext:
        """Device-only (capturable): the attention metadata of a decode step."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        ctx = AttentionContext(
            positions=positions, rope=self.model.model.rotary.tables(positions), write_rows=None,
            write_slots=write_slots, q_index=None, q_flat=None, q_pos=None, key_slots=None, g_mask=None,
            global_kv=self.kv.global_kv, index_keys=self.kv.index_keys, kv_scale=self.kv.kv_scale,
            index_scale=self.kv.index_scale,
            compute_dtype=self.dtype)
        ring_pos = None
        if self.kv.window:
            ctx.window_kv, ctx.window_slots = self.kv.window_kv, window_slots
            ring_pos = self.kv.window_pos[window_slots]
            ctx.win_write_rows, ctx.win_write_slot = rows, window_slots
            ctx.win_write_idx = positions % self.kv.window
        ctx.decode = build_decode_batch(positions, block_tables, self.cfg.block_size, self.kv.window, ring_pos, sparse)
        return ctx

    def decode_forward(self, input_ids, positions, write_slots, block_tables, window_slots, sparse,
                       logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step on index tensors -> logits of every row (capturable). logits_out: where
        to write them ([rows, vocab] fp32), so that graphs share one buffer rather than each
        keeping its own."""
        ctx = self.decode_context(positions, write_slots, block_tables, window_slots, sparse)
        hidden = self.model(input_ids, ctx)
        if self.kv.window:
            self.kv.window_pos[window_slots, ctx.win_write_idx] = positions
        return self.model.compute_logits(hidden, logits_out)

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
        tables = np.zeros((b, max_blocks), dtype=np.int64)
        for i, seq in enumerate(batch.seqs):
            t = _table_array(seq)[:max_blocks]
            tables[i, :len(t)] = t
        tables = torch.from_numpy(tables)
        # Past index_topk positions each row reads at most index_topk + 2W keys: the kernels
        # attend row by row (no [B, N, C] scores or masks). Shorter contexts and dense models
        # keep the padded path, whose attention is a few large matmuls; a row-by-row dense
        # prefill would read every key once per query.
        topk = self.model.cfg.index_topk
        token_rows = self.cfg.decode_kernels and topk is not None and c_max > topk
        dev = self.device
        key_slots = None
        if not token_rows:
            j = torch.arange(c_max)
            key_slots = (tables[:, j // bs] * bs + j % bs).to(dev)
        q_index, q_pos = q_index.to(dev), q_pos.to(dev)
        context_lens = self._tensor(ctx_lens)
        positions = self._tensor(positions)
        ctx = AttentionContext(
            positions=positions, rope=self.model.model.rotary.tables(positions), write_rows=self._tensor(write_rows),
            write_slots=self._tensor(write_slots), q_index=q_index, q_flat=self._tensor(q_flat), q_pos=q_pos,
            key_slots=key_slots, g_mask=None,
            global_kv=self.kv.global_kv, index_keys=self.kv.index_keys, kv_scale=self.kv.kv_scale,
            index_scale=self.kv.index_scale,
            compute_dtype=self.dtype)
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
        if token_rows:
            seq_of = torch.repeat_interleave(torch.arange(b), torch.tensor(batch.num_tokens))
            ctx.decode = build_token_batch(
                positions, torch.tensor(starts)[seq_of].to(dev), seq_of.to(dev), tables.to(dev, torch.int32), bs,
                self.kv.window, ring_pos, sparse=True)
        else:
            ctx.g_mask, ctx.w_mask = build_masks(q_pos, context_lens, c_max, self.kv.window, ring_pos)
        return self._tensor(ids), ctx, logit_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """One forward over the batch. Returns the indices (into the batch) of the sequences
        whose last known token was computed, and their next-token logits. With expert
        parallelism an empty batch still runs (the group's collectives need every rank)."""
        if self.ep is not None:
            return run_lockstep(self, batch)
        longest = self.decode_length(batch)
        if longest and self.graphs is not None and self.graphs.covers(len(batch)):
            self.model.model.rotary.ensure(longest)
            return list(range(len(batch))), self.graphs.run(batch, longest)[:len(batch)]
        return self.run_eager(batch, longest)

    def run_eager(self, batch: ScheduledBatch, longest: int, ahead_ids: torch.Tensor | None = None
                  ) -> tuple[list[int], torch.Tensor | None]:
        """run() without decode graphs (chunk graphs still, where they take the step); `longest`:
        decode_length(batch), or with ahead_ids (run_ahead) the tokens one past the longest."""
        if longest:
            b = len(batch)
            self.model.model.rotary.ensure(longest)
            ids, *rest = self.decode_inputs(batch, ahead=int(ahead_ids is not None))
            if ahead_ids is not None:
                ids[:b].copy_(ahead_ids)
            return list(range(b)), self.decode_forward(ids, *rest)[:b]
        rows = self.chunk_rows(batch)
        if rows:
            return self.run_chunk(batch, rows)
        input_ids, ctx, logit_rows = self.prepare(batch)
        hidden = self.model(input_ids, ctx)
        if self.kv.window:
            self.kv.window_pos[ctx.win_write_slot, ctx.win_write_idx] = ctx.positions[ctx.win_write_rows]
        rows, targets, owners = prompt_logprob_rows(batch.seqs, batch.num_tokens)
        if rows:
            k = max(seq.params.prompt_logprobs for seq, _ in owners)
            self.prompt_records = (owners, targets, prompt_token_logprobs(self.model.compute_logits, hidden, rows,
                                                                          targets, k))
        done = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        return done, (self.model.compute_logits(hidden[logit_rows]) if done else None)

    def run_chunk(self, batch: ScheduledBatch, rows: int, shape: tuple[int, int, bool] | None = None,
                  ahead_ids: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor | None]:
        """A step of `rows` tokens replayed from a chunk graph, each token a row; `shape`: the
        graph's (rows, width, sparse) chosen by a lockstep group (the batch may be empty then);
        ahead_ids: a decode step launched ahead (run_ahead), a row per sequence."""
        for s in batch.new_window_slots:
            self.kv.window_pos[s] = -1
        ahead = int(ahead_ids is not None)
        if len(batch):
            self.model.model.rotary.ensure(max(seq.num_computed_tokens + n
                                               for seq, n in zip(batch.seqs, batch.num_tokens)))
        logits = self.graphs.run_chunk(batch, rows, shape, ahead_ids)
        done = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens + ahead]
        return done, (logits[:len(done)] if done else None)

    @torch.inference_mode()
    def run_ahead(self, batch: ScheduledBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """A decode step launched before the previous step's tokens were read back: each
        sequence's input token is `input_ids` (on the device, one per sequence, in batch order),
        at the position after its last known token, for which it holds a block. Returns the
        next-token logits of every sequence."""
        if self.ep is not None:
            return run_lockstep(self, batch, input_ids)[1]
        b = len(batch)
        longest = max(seq.num_tokens for seq in batch.seqs) + 1
        self.model.model.rotary.ensure(longest)
        if self.graphs is not None and self.graphs.covers(b):
            return self.graphs.run(batch, longest, input_ids)[:b]
        return self.run_eager(batch, longest, input_ids)[1]

    def run_idle(self) -> None:
        """A forward with no tokens: only the MoE layers' collectives, in the same order as a
        real forward (expert parallelism, eager steps)."""
        empty = torch.empty(0, self.model.cfg.hidden_size, device=self.device, dtype=self.dtype)
        for moe in self.model.moe_layers():
            self.ep.moe_forward(moe, empty)

    def sample(self, seqs, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each sequence, on the device (not waited for)."""
        params = [s.params for s in seqs]
        copied = False
        if any(p.adjusts_logits for p in params):
            penalized, count_rows = [s for s in seqs if s.params.penalized], None
            if penalized:
                if self.token_counts is None:
                    self.token_counts = TokenCounts(logits.shape[-1], logits.device)
                count_rows = self.token_counts.rows(penalized)
            logits, copied = adjust_logits(logits, params, self.token_counts, count_rows), True
        constrained = [i for i, s in enumerate(seqs) if s.constraint is not None and s.constraint.active]
        if constrained:
            logits = self._mask_grammar(logits, [seqs[i].constraint for i in constrained], constrained, copy=not copied)
            copied = True
        # a row short of its min_tokens may not end: its stop tokens are out (a grammar's end is its own)
        eos = [] if self.eos_token_id is None else [self.eos_token_id]
        banned = [(j, t) for j, s in enumerate(seqs) if len(s.output_ids) < s.params.min_tokens and s.constraint is None
                  for t in eos + s.params.stop_token_ids]
        if banned:
            logits = logits if copied else logits.clone()
            at = host_to_device(self.device, np.array(banned, dtype=np.int64).T.copy())
            logits[at[0], at[1]] = float("-inf")
        return self.sampler.sample(logits, params, [s.generator for s in seqs])

    def _mask_grammar(self, logits: torch.Tensor, constraints: list, rows: list[int], copy: bool) -> torch.Tensor:
        """`logits` with every token a row's grammar does not allow next at -inf: a copy unless
        already one (logprobs report the model's own distribution)."""
        n, words = len(rows), (logits.shape[-1] + 31) // 32
        # the mask words, then the rows they apply to, in one host array: one copy to the device.
        # Filled in pinned memory, where a copy from pageable memory first stages all of it there
        # (1 MB at batch 64 of 129K tokens). The rows start on a 16-byte boundary whatever n is:
        # the kernel is built for its pointers' alignment, and the warm-up builds one.
        cuda = self.device.type == "cuda"
        at = (n * words + 3) // 4 * 4
        host = torch.empty(at + n, dtype=torch.int32, pin_memory=cuda)
        fill_masks(constraints, host[:n * words].view(n, words))
        host[at:] = torch.tensor(rows, dtype=torch.int32)
        both = host.to(self.device, non_blocking=True) if cuda else host
        if copy:
            logits = logits.clone()
        apply_token_mask(logits, both[:n * words].view(n, words), both[at:])
        return logits
