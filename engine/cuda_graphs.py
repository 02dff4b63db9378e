"""Decode steps replayed from CUDA graphs.

A decode step of a few billion parameters is hundreds of small kernels; at low batch the
GPU waits on Python to launch them. One graph per (padded batch size, padded block-table
width, sparse or dense attention) is captured the first time that shape is seen and replayed
after: the step's index tensors are written on the host into one pinned buffer and copied in
one transfer into the graph's static buffer, of which the graph's inputs are views; nothing else
crosses the host. (Each torch call costs tens of microseconds of host time on a busy host, while
the GPU waits: the path is one copy and one replay.) Batches pad up to the next captured size;
padding rows write to the KV cache's scratch block and window ring. Their routed tokens do land in the MoE layers' per-slot load counts,
as does the eager warm-up of each capture; those counts feed only the load balancer, which
runs with expert parallelism, where padding rows are dropped before the experts (engine/ep.py).
With expert parallelism the graph's shape is the group's (`shape`, engine/ep_step.py) and every
rank captures it at the same step: NCCL wants a captured collective captured and replayed by
all ranks together, so a capture that fails on one rank is dropped by all. An engine left idle
captures ahead the next width of each batch size serving reached (capture_ahead), so that a
conversation's next turn, its context longer, does not stall on it; the ranks of a lockstep
group do so together, after as many idle steps.
"""
from __future__ import annotations

import gc
import logging
import time

import numpy as np
import torch

from .scheduler import ScheduledBatch
from .streams import side_stream

log = logging.getLogger(__name__)


def _batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def _chunk_sizes(max_chunk: int) -> list[int]:
    """Padded row counts of the chunk graphs: the decode sizes up to 128 rows, then powers of two
    up to max_chunk. Each size is captured once for every block-table width it meets, so past
    128 rows there are few sizes, padded further: padding rows cost a step little, as its
    weights are read once whatever the rows."""
    sizes = set(_batch_sizes(min(max_chunk, 128)))
    n = 256
    while n < max_chunk:
        sizes.add(n)
        n *= 2
    return sorted(sizes | {max_chunk})


def min_graph_blocks(cfg, model_cfg, max_tokens: int) -> int:
    """Narrowest block-table width of a graph (EngineConfig.cuda_graph_min_tokens): by default
    the widest table a step that attends densely can have, so every such step of a batch size
    shares one graph, captured at start. The dense attention kernel splits a row's keys by the
    table's width but reads only its own (wideep_kernels/mla_decode.py), so a short context
    costs a wider table little."""
    tokens = cfg.cuda_graph_min_tokens
    if tokens is None:
        window = model_cfg.sliding_window - 1 if model_cfg.sliding_window else 0
        tokens = model_cfg.index_topk + window if model_cfg.index_topk else 2048
    return max(16, -(-min(tokens, max_tokens) // cfg.block_size))


def blocks_bucket(num_blocks: int) -> int:
    """Padded block-table width of a graph: at least 16 blocks, then four steps per octave
    (n in (2^k, 2^(k+1)] rounds up to a multiple of 2^(k-2)). The indexer scores and selects
    over the whole padded width, so powers of two cost up to 2x at long context (1M positions
    for a 512K one); this keeps it under 1.25x with four times the graphs."""
    if num_blocks <= 16:
        return 16
    step = (1 << (num_blocks - 1).bit_length()) // 8
    return -(-num_blocks // step) * step


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = _batch_sizes(min(max_batch, runner.cfg.max_num_seqs))
        # Chunk steps have a row per token, whatever the number of sequences.
        max_chunk = min(runner.cfg.cuda_graph_max_chunk, runner.cfg.max_num_batched_tokens)
        self.chunk_sizes = _chunk_sizes(max_chunk) if max_chunk else [0]
        # (form, padded rows, padded block-table width, sparse) -> (graph, static inputs, logits);
        # form "decode" (a token per sequence) or "chunk" (prompt chunks: a row per token).
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None
        self.failed: set[tuple] = set()
        # (form, padded rows, sparse) of the graphs captured: a capture of another width of these
        # runs the same kernels, already built and initialised, and skips the eager run first.
        self.warmed: set[tuple] = set()
        cfg = runner.cfg
        limit = min(runner.model.cfg.max_position_embeddings, cfg.num_blocks * cfg.block_size)
        self.rotary = runner.model.model.rotary
        self.rotary.ensure(cfg.max_model_len or limit)
        self.min_blocks = min_graph_blocks(cfg, runner.model.cfg, cfg.max_model_len or limit)
        self.max_blocks = self._blocks_bucket(-(-(cfg.max_model_len or limit) // cfg.block_size))
        # (form, padded rows) -> (widest padded width, sparse) that serving replayed: capture_ahead
        # takes the next width of each. With expert parallelism, the group's shapes: every rank's
        # the same.
        self.widest: dict[tuple[str, int], tuple[int, bool]] = {}
        # Captures met by serving steps (each stalls every running request) and their seconds;
        # those of capture_short and capture_ahead are made with no request waiting.
        self.captures_serving, self.capture_serving_s, self.captures_ahead = 0, 0.0, 0
        self._preparing = False
        # Host staging of the inputs (pinned, so the copy is a DMA the host does not wait on),
        # grown as needed; `copied` marks the end of the last copy out of it, which must be
        # over before the buffer is written again.
        self.staging: torch.Tensor | None = None
        self.staging_host: np.ndarray | None = None
        self.copied: torch.cuda.Event | None = None
        self.capture_stream: torch.cuda.Stream | None = None
        self.logits: torch.Tensor | None = None  # _logits

    def covers(self, batch_size: int) -> bool:
        return batch_size <= self.sizes[-1]

    def group_shape(self, rows: int, width: int, sparse: bool) -> tuple[int, int, bool]:
        """(padded rows, padded block-table width, sparse) of the graph for a lockstep group's
        step: its most rows and widest table over all ranks."""
        return next(s for s in self.sizes if s >= rows), self._blocks_bucket(max(width, 1)), sparse

    def covers_chunk(self, rows: int) -> bool:
        return rows <= self.chunk_sizes[-1]

    def group_chunk_shape(self, rows: int, width: int, sparse: bool) -> tuple[int, int, bool]:
        """(padded rows, padded block-table width, sparse) of the chunk graph for a lockstep
        group's step: its most tokens and widest table over all ranks."""
        return next(s for s in self.chunk_sizes if s >= rows), self._blocks_bucket(max(width, 1)), sparse

    def _blocks_bucket(self, num_blocks: int) -> int:
        """The graph width of a table of num_blocks: min_blocks up to it, four per octave past it."""
        return self.min_blocks if num_blocks <= self.min_blocks else blocks_bucket(num_blocks)

    @torch.inference_mode()
    def capture_short(self) -> int:
        """Capture every decode and chunk graph of the narrowest width (min_blocks) that is not
        captured yet: the graphs of every context below it. Their rows are all padding (the
        scratch slot and ring). With expert parallelism every rank calls this at the same time,
        and captures the same shapes in the same order, each with no real row
        (ExpertParallel.pad_only). Returns how many were captured."""
        before, lockstep = len(self.graphs), self.runner.ep
        self._preparing = True
        try:
            self._capture_short(lockstep)
        finally:
            self._preparing = False
        return len(self.graphs) - before

    def _capture_short(self, lockstep) -> None:
        # Sparse steps too where cuda_graph_min_tokens reaches past the dense contexts (by more
        # than the width's last block, which rounding up to blocks adds by default).
        bs = self.runner.cfg.block_size
        forms = [False, True] if self.runner.needs_sparse((self.min_blocks - 1) * bs + 1) else [False]
        for sparse in forms:
            for rows in self.sizes:
                if lockstep is not None:
                    lockstep.pad_only(rows)
                self.run(ScheduledBatch(), shape=(rows, self.min_blocks, sparse))
            if self.runner.cfg.decode_kernels and self.chunk_sizes != [0]:
                for rows in self.chunk_sizes:
                    if lockstep is not None:
                        lockstep.pad_only(rows)
                    self.run_chunk(ScheduledBatch(), rows, shape=(rows, self.min_blocks, sparse))

    def ahead_shapes(self) -> list[tuple]:
        """Graphs serving will likely meet next, not captured yet: for each (form, rows) that
        serving replayed, the next width past the widest it replayed (contexts grow into it),
        sparse where that width's contexts need the indexer. Only one width ahead of what serving
        reached, so idle time never walks the widths up to max_model_len."""
        bs, keys = self.runner.cfg.block_size, []
        for (form, rows), (width, sparse) in sorted(self.widest.items()):
            nxt = blocks_bucket(width + 1)
            if nxt > self.max_blocks:
                continue
            key = (form, rows, nxt, sparse or self.runner.needs_sparse(width * bs + 1))
            if key not in self.graphs and key not in self.failed:
                keys.append(key)
        return keys

    @torch.inference_mode()
    def capture_ahead(self) -> bool:
        """Capture the first of ahead_shapes, its rows all padding (the scratch slot and ring), so
        that serving does not stall on it later; for an idle engine (LLMEngine.housekeeping). With
        expert parallelism every rank calls it at the same step, as capture_short: the group's
        shapes are the same on every rank, so each captures the same graph. Returns whether there
        was one to capture."""
        keys = self.ahead_shapes()
        if not keys:
            return False
        form, rows, width, sparse = keys[0]
        if self.runner.ep is not None:
            self.runner.ep.pad_only(rows)
        self._preparing = True
        try:
            if form == "decode":
                self.run(ScheduledBatch(), shape=(rows, width, sparse))
            else:
                self.run_chunk(ScheduledBatch(), rows, shape=(rows, width, sparse))
        finally:
            self._preparing = False
        self.captures_ahead += 1
        return True

    def forget_serving(self) -> None:
        """Drop what serving met so far (the warm-up's requests are not serving)."""
        self.widest.clear()
        self.captures_serving, self.capture_serving_s, self.captures_ahead = 0, 0.0, 0

    def _served(self, form: str, rows: int, width: int, sparse: bool) -> None:
        if not self._preparing and width > self.widest.get((form, rows), (0, False))[0]:
            self.widest[(form, rows)] = (width, sparse)

    def _host_buffer(self, nbytes: int) -> np.ndarray:
        if self.copied is not None:
            self.copied.synchronize()
        if self.staging is None or self.staging.numel() < nbytes:
            self.staging = torch.empty(max(nbytes, 2 * (0 if self.staging is None else self.staging.numel())),
                                       dtype=torch.uint8, pin_memory=True)
            self.staging_host = self.staging.numpy()
        return self.staging_host

    def run(self, batch, longest: int | None = None, ahead_ids: torch.Tensor | None = None,
            shape: tuple[int, int, bool] | None = None) -> torch.Tensor:
        """Replay (capturing first if new) the graph of this decode step's shape; `longest`: the
        tokens of its longest sequence, when the caller has them. ahead_ids: the input tokens,
        on the device, of a step launched ahead (ModelRunner.run_ahead); `longest` counts them.
        shape: (rows, width, sparse) chosen by the caller (group_shape) instead of from this
        batch, which may be empty then."""
        r = self.runner
        b, ahead = len(batch), int(ahead_ids is not None)
        if shape is None:
            pad_b = next(s for s in self.sizes if s >= b)
            pad_m = self._blocks_bucket(r.decode_width(batch, longest))
        else:
            pad_b, pad_m, _ = shape
        nbytes = r.decode_input_bytes(pad_b, pad_m)[1]
        sparse = r.fill_decode_inputs(batch, self._host_buffer(nbytes), pad_b, pad_m, ahead)
        if shape is not None:
            sparse = shape[2]  # the group's: a short-context rank's top-k then keeps every entry
        self._served("decode", pad_b, pad_m, sparse)
        return self._replay(("decode", pad_b, pad_m, sparse), nbytes, self._ahead_fill(ahead_ids),
                            lambda static: r.decode_forward(*r.decode_input_views(static, pad_b, pad_m), sparse,
                                                            logits_out=self._logits(pad_b)))

    def run_chunk(self, batch, rows: int, shape: tuple[int, int, bool] | None = None,
                  ahead_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay (capturing first if new) the graph of a step of `rows` tokens, each a kernel row
        (ModelRunner.chunk_forward): prompt chunks, alone or beside decoding sequences. Returns
        the logits of the sequences whose next token is due, in batch order. shape: (rows, width,
        sparse) chosen by the caller (group_chunk_shape) instead of from this batch, which may be
        empty then). ahead_ids: the input tokens, on the device, of a decode step launched ahead
        (a row per sequence, as in run)."""
        r = self.runner
        if shape is None:
            pad_r = next(s for s in self.chunk_sizes if s >= rows)
            longest = max(seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens))
            pad_m = self._blocks_bucket(r.decode_width(batch, longest))
        else:
            pad_r, pad_m, _ = shape
        nbytes = r.chunk_input_bytes(pad_r, pad_m)[1]
        ahead = int(ahead_ids is not None)
        sparse, logit_rows = r.fill_chunk_inputs(batch, self._host_buffer(nbytes), pad_r, pad_m, ahead)
        if shape is not None:
            sparse = shape[2]  # the group's, as for decode graphs
        self._served("chunk", pad_r, pad_m, sparse)
        logits = self._replay(("chunk", pad_r, pad_m, sparse), nbytes, self._ahead_fill(ahead_ids),
                              lambda static: r.chunk_forward(*r.chunk_input_views(static, pad_r, pad_m), sparse,
                                                             logits_out=self._logits(r.chunk_logit_rows(pad_r))),
                              keep=lambda: r.window_snapshot(batch))
        return logits[:len(logit_rows)]

    def _logits(self, rows: int) -> torch.Tensor:
        """Where every graph writes its logits: one buffer, outside the graphs' pool, of which each
        graph's are the first rows. Kept per graph, they would hold [rows, vocab] floats for every
        width captured (1.1 GB a width over the 1-256 sizes of a 129K vocabulary). Replays run one
        at a time on one stream, each step's sampling queued before the next replay."""
        if self.logits is None:
            r = self.runner
            rows_max = max(self.sizes[-1], r.chunk_logit_rows(self.chunk_sizes[-1]))
            self.logits = torch.empty(rows_max, r.model.cfg.vocab_size, dtype=torch.float32, device=r.device)
        return self.logits[:rows]

    @staticmethod
    def _ahead_fill(ahead_ids: torch.Tensor | None):
        """The ids of a step launched ahead into its uploaded inputs: both layouts start with the
        int64 ids, a row per sequence."""
        if ahead_ids is None:
            return None
        return lambda static: static[:8 * ahead_ids.numel()].view(torch.int64).copy_(ahead_ids)

    def _replay(self, key: tuple, nbytes: int, fill, forward, keep=None) -> torch.Tensor:
        """Upload the staged inputs into the graph of `key` (forward(static buffer) -> logits,
        captured first if new), let fill(static) change them on the device, and replay. A shape
        that cannot be captured runs eagerly on the same buffer. keep() -> restore(): state the
        capture's warm-up run changes and the replay must see as it was."""
        if self._tables_moved():
            self.clear()  # they read the rope tables a longer context has since replaced
        if key not in self.graphs and key not in self.failed:
            lockstep, t0 = self.runner.ep, time.perf_counter()
            warm = (key[0], key[1], key[3]) in self.warmed
            try:
                try:
                    self.graphs[key] = self._capture(nbytes, fill, forward, keep, eager_first=not warm)
                except RuntimeError:
                    # Once more after an eager run, unless it already had one. Not in a lockstep
                    # group: the eager run's collectives would be this rank's alone.
                    if not warm or lockstep is not None:
                        raise
                    torch.cuda.synchronize()
                    self.graphs[key] = self._capture(nbytes, fill, forward, keep, eager_first=True)
                self.warmed.add((key[0], key[1], key[3]))
            except RuntimeError as e:
                log.warning("CUDA graph capture failed for %s (%s); running it eagerly", key, e)
                self.failed.add(key)
                torch.cuda.synchronize()
            if lockstep is not None and not lockstep.all_agree(key in self.graphs):
                self.graphs.pop(key, None)  # replayed by this rank alone, its collectives would hang
                self.failed.add(key)
            if not self._preparing:
                self.captures_serving += 1
                self.capture_serving_s += time.perf_counter() - t0
        if key in self.failed:
            static = torch.empty(nbytes, dtype=torch.uint8, device=self.runner.device)
            self._upload(static, nbytes)
            if fill is not None:
                fill(static)
            return forward(static)
        graph, static, logits = self.graphs[key]
        self._upload(static, nbytes)
        if fill is not None:
            fill(static)
        graph.replay()
        self.last = graph  # benchmarks time the replay alone
        return logits

    def _upload(self, static: torch.Tensor, nbytes: int) -> None:
        static.copy_(self.staging[:nbytes], non_blocking=True)
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.record()

    def clear(self) -> None:
        """Drop every graph, and their memory pool with them (a new capture starts a new pool)."""
        self.graphs.clear()
        self.pool = None

    def _tables_moved(self) -> bool:
        ptr = self.rotary.cos.data_ptr()
        moved = getattr(self, "_cos_ptr", ptr) != ptr
        self._cos_ptr = ptr
        return moved

    def _capture(self, nbytes: int, fill, forward, keep=None, eager_first: bool = True):
        """Capture forward(static), its inputs a static buffer that already holds this step's
        values (the replay that follows computes the step). eager_first: run the forward eagerly
        first, on a side stream, for what a capture cannot do (a kernel's first build and load,
        lazy initialisation); the first capture of a (form, rows, sparse) needs it, other widths
        of it do not (skipping it took a capture from 40-48 to 24-30 ms on the H200). A decode step's eager run leaves
        nothing its replay reads differently; a prompt chunk's does (its window ring then already
        holds the chunk's later positions), so keep() restores that."""
        r = self.runner
        static = torch.empty(nbytes, dtype=torch.uint8, device=r.device)
        self._upload(static, nbytes)
        if fill is not None:
            fill(static)
        if eager_first:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            restore = keep() if keep is not None else None
            with torch.cuda.stream(stream):
                forward(static)
            torch.cuda.current_stream().wait_stream(stream)
            if restore is not None:
                restore()
        graph = torch.cuda.CUDAGraph()
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(r.device)
        side_stream(r.device)  # made before the capture, which forks onto it
        self._before_capture()
        # A CUDA graph destroyed while another is being captured (an unreachable engine's graphs,
        # freed by the cyclic collector at some allocation) invalidates the capture: the
        # collector stays off until the capture ends.
        gc.disable()
        try:
            with torch.cuda.stream(self.capture_stream):
                graph.capture_begin(pool=self.pool)
                try:
                    logits = forward(static)
                finally:
                    graph.capture_end()
        finally:
            gc.enable()
        if self.pool is None:
            self.pool = graph.pool()
        return graph, static, logits

    def _before_capture(self) -> None:
        """What a capture starts from: the device idle. torch.cuda.graph would also empty the
        allocator's caches (the next allocations then go back to the driver) and may collect
        garbage (0.15 s in a process with Ray and transformers loaded, on a 2-core host);
        neither is done: a capture met while serving stalls every running request."""
        torch.cuda.synchronize()
