"""Paged KV blocks with hash-chained prefix caching, and the window-KV ring slots.

A full block's hash covers its tokens and the hash of the block before it, so equal hashes
mean equal prefixes. A block is published in the prefix cache only once its KV has been
computed, so a concurrent request can never hit a block that is still being filled.
Freed blocks keep their hash and stay hittable until they are reused (LRU order).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from contextlib import contextmanager

from .sequence import Sequence


def block_hash(prev: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(prev + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    # prefix cache -----------------------------------------------------------------------
    def chain_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of the sequence's block i (its tokens and every block before it), from the
        sequence's cache of them, extended as needed."""
        chain, bs = seq.block_hashes, self.block_size
        while len(chain) <= i:
            j = len(chain)
            chain.append(block_hash(chain[-1] if chain else b"", seq.token_slice(j * bs, (j + 1) * bs)))
        return chain[i]

    def match_prefix(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Cached blocks covering the longest hashed prefix of the sequence's first `num_tokens`
        tokens (all of them by default), leaving at least one token to compute (its logits are
        needed)."""
        if not self.enable_prefix_caching:
            return []
        n = seq.num_tokens if num_tokens is None else num_tokens
        hits = []
        for i in range((n - 1) // self.block_size):
            block = self.cached.get(self.chain_hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def take_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(blocks)
        seq.num_hashed_blocks = len(blocks)
        seq.prefix_hash = self.block_hash[blocks[-1]] if blocks else b""

    def publish(self, seq: Sequence) -> None:
        """Hash the sequence's blocks whose KV is now fully computed."""
        bs = self.block_size
        if not self.enable_prefix_caching or seq.num_computed_tokens // bs <= seq.num_hashed_blocks:
            return  # most calls (a decode step, one token each): no block filled
        full = min(seq.num_computed_tokens, seq.num_tokens) // bs
        for i in range(seq.num_hashed_blocks, full):
            b = seq.block_table[i]
            # the block's tokens alone: a decode step calls this for every sequence, and copying a
            # long context's whole token list took 1.1 ms a sequence at 512K
            h = self.chain_hash(seq, i)
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
            seq.prefix_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    # allocation -------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_positions: int, extra_taken: int = 0) -> bool:
        need = self.blocks_needed(num_positions) - len(seq.block_table)
        return need <= len(self.free) - extra_taken

    def grow(self, seq: Sequence, num_positions: int) -> None:
        """Give the sequence blocks for positions [0, num_positions)."""
        while len(seq.block_table) < self.blocks_needed(num_positions):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None:  # evict its cached prefix entry
                if self.cached.get(old) == b:
                    del self.cached[old]
                self.block_hash[b] = None
            self.ref_count[b] = 1
            seq.block_table.append(b)

    @contextmanager
    def withheld(self, blocks: list[int]):
        """Keep these free blocks out of every allocation inside the block. Only blocks without a
        cached prefix can be withheld (a prefix hit may revive a cached one); they come back as
        the first to be reused, having no cached content to keep."""
        for b in blocks:
            if self.block_hash[b] is not None:
                raise ValueError(f"block {b} holds a cached prefix and cannot be withheld")
            del self.free[b]
        try:
            yield
        finally:
            for b in blocks:
                self.free[b] = None
                self.free.move_to_end(b, last=False)

    def release(self, seq: Sequence) -> None:
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.prefix_hash = b""


    def release_blocks(self, blocks: list[int]) -> None:
        # Later blocks are the least likely to be shared: free them first so they are evicted first.
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None


class WindowSlots:
    """One window-KV ring per running sequence."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int:
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)
