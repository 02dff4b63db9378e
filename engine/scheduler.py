"""Continuous batching with chunked prefill, prefix-cache admission and window-KV replay.

Each step has a token budget. Running requests go first (decodes cost one token, unfinished
prefills take a chunk); waiting requests are then admitted while budget, blocks and slots
last. When blocks run out, the most recently admitted request is preempted and later
recomputed (its prefix blocks usually hit the cache again).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, WindowSlots
from .config import EngineConfig, ModelConfig
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    new_window_slots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig):
        self.cfg = cfg
        self.window = model_cfg.sliding_window
        self.num_layers = model_cfg.num_hidden_layers
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.window_slots = WindowSlots(cfg.max_num_seqs) if self.window else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.awaiting_kv: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.quarantine: list[tuple[float, list[int]]] = []  # (free after, blocks) of abandoned transfers
        self.prefix_hit_tokens = 0
        self.replayed_tokens = 0
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # KV from a prefill server ---------------------------------------------------------
    def reserve_for_remote(self, seq: Sequence) -> tuple[int, list[int]] | None:
        """Blocks for the whole prompt, locally cached prefix included. Returns (number of
        leading blocks already cached here, blocks the prefill server must fill), or None
        when the pool cannot hold the prompt right now."""
        hits = self.blocks.match_prefix(seq, len(seq.prompt_ids))
        revived = sum(1 for b in hits if self.blocks.ref_count[b] == 0)
        need = self.blocks.blocks_needed(len(seq.prompt_ids)) - len(hits)
        if need > self.blocks.num_free_blocks - revived:
            return None
        self.blocks.take_prefix(seq, hits)
        self.blocks.grow(seq, len(seq.prompt_ids))
        seq.prefix_hit_tokens += len(hits) * self.cfg.block_size
        self.prefix_hit_tokens += len(hits) * self.cfg.block_size
        seq.status = Status.AWAITING_KV
        self.awaiting_kv[seq.request_id] = seq
        return len(hits), seq.block_table[len(hits):]

    def kv_arrived(self, seq: Sequence) -> None:
        """The prompt's global KV is in place: queue it; admission replays only the window."""
        del self.awaiting_kv[seq.request_id]
        seq.remote_tokens = len(seq.prompt_ids) - seq.prefix_hit_tokens
        seq.num_cached_tokens = len(seq.prompt_ids)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def kv_failed(self, seq: Sequence, quarantine_until: float | None = None) -> None:
        """The transfer failed or came late: drop the reservation and prefill locally.
        A write that may still be in flight must not land in blocks another request owns, so
        with quarantine_until the reserved blocks stay out of the pool until that time."""
        del self.awaiting_kv[seq.request_id]
        self._set_aside(seq, quarantine_until)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def _set_aside(self, seq: Sequence, until: float | None) -> None:
        if until is None or until <= time.monotonic():
            self.blocks.release(seq)
            return
        self.quarantine.append((until, seq.block_table))
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.prefix_hash = b""

    def release_quarantine(self, now: float) -> None:
        keep = []
        for until, blocks in self.quarantine:
            if until <= now:
                self.blocks.release_blocks(blocks)
            else:
                keep.append((until, blocks))
        self.quarantine = keep

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.blocks.release(seq)

    def replay_start(self, hit: int) -> int:
        """Where compute resumes after a prefix hit ending at `hit`: the window KV is never
        cached, so the last W tokens are replayed (bounded), or enough tokens for every
        layer's window to be exactly what a cold run computes (exact: W * num_layers)."""
        if not self.window or hit == 0:
            return hit
        span = self.window if self.cfg.replay_mode == "bounded" else self.window * self.num_layers
        return max(0, hit - span)

    def schedule(self) -> ScheduledBatch:
        if self.quarantine:
            self.release_quarantine(time.monotonic())
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        queue = deque(self.running)
        self.running = []
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            self.running.append(seq)
            budget -= n
        self.running.extend(queue)

        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            if seq.window_slot is not None:
                batch.new_window_slots.append(seq.window_slot)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            self.running.append(seq)
            budget -= n
        return batch

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take prefix hits and blocks for the first chunk; 0 if it does not fit now."""
        if seq.block_table:  # KV that arrived from a prefill server: its blocks are already held
            hit = seq.num_cached_tokens
            start = self.replay_start(hit)
            n = min(seq.num_tokens - start, budget)
            if not self.blocks.can_grow(seq, start + n):
                return 0
        else:
            # prompt logprobs need every prompt position computed
            hits = [] if seq.needs_prompt_logprobs else self.blocks.match_prefix(seq)
            hit = len(hits) * self.cfg.block_size
            start = self.replay_start(hit)
            n = min(seq.num_tokens - start, budget)
            revived = sum(1 for b in hits if self.blocks.ref_count[b] == 0)  # cached blocks now in the free list
            need = self.blocks.blocks_needed(start + n) - len(hits)
            if need > self.blocks.num_free_blocks - revived:
                return 0
            self.blocks.take_prefix(seq, hits)
            seq.num_cached_tokens = hit
            seq.prefix_hit_tokens += hit
            self.prefix_hit_tokens += hit
        self.blocks.grow(seq, start + n)
        seq.num_computed_tokens = start
        seq.replayed_tokens += hit - start
        self.replayed_tokens += hit - start
        if self.window_slots is not None:
            seq.window_slot = self.window_slots.take()
        seq.status = Status.RUNNING
        return n

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status == Status.AWAITING_KV:
            # a prefill server may be writing into its blocks right now
            del self.awaiting_kv[seq.request_id]
            self._set_aside(seq, time.monotonic() + self.cfg.remote_kv_grace_s)
        if seq.hold_kv and reason not in ("abort", "error"):
            self._release_window(seq)
            self.held[seq.request_id] = seq
        else:
            self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self._release_window(seq)

    def _release_window(self, seq: Sequence) -> None:
        if seq.window_slot is not None:
            self.window_slots.give(seq.window_slot)
            seq.window_slot = None
