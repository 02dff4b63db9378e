"""Same-host KV transport ("ipc"): the prefill engine writes a request's blocks straight into
the decode engine's KV pool, which it has mapped into its own process, so a transfer runs at
the speed of a local copy (CPU) or a peer copy over NVLink (GPU). engine/kv_transfer.py (NIXL)
stays for engines on different hosts. No Ray here: the control plane carries the handle and the
block ids.

Layout contract (as for NIXL): every pool tensor is [layers, num_slots] or [layers, num_slots,
width] and contiguous, num_slots = num_blocks * block_size; both sides agree on the number of
tensors and on each one's layers, width and dtype and on block_size; pool sizes may differ.

Export (decode side): metadata() is a small picklable dict, made once per transport.
- CUDA: each pool tensor as torch's CUDA-IPC reduction (a rebuild function and its arguments);
  the importer maps the same device memory. The exporter keeps its tensors alive (the engine
  does). CUDA cannot open a process's own handle, so a peer in the same process is served from
  a registry instead.
- CPU: the pool tensors must be files in /dev/shm. Building the engine inside shared_kv_pool()
  makes KVCache put them there; the handle names each file with its inode, shape and dtype.
  The files are unlinked when the exporter closes, by a finaliser at exit, or, after a crash,
  by the next pool created on this host once the process that made them is gone.

Import and write (prefill side): connect(meta) opens a peer's pool once (same host only), and
write_blocks(peer, src_blocks, dst_blocks) does, for each pool tensor, dst[:, dst_blocks] =
src[:, src_blocks] block by block. Runs of blocks that are consecutive on both sides are copied
one strided copy per run; many runs (scattered blocks) go through a gather into a contiguous
buffer and a scatter into the mapped pool. On CUDA the copies are kernels of the local GPU whose
stores cross NVLink (the peer's memory is mapped into our device's context), on a side stream
that first waits for the work already queued (the forward that wrote the KV), so the engine's
next forward overlaps the copy. On CPU a worker thread copies.

There is no notification: when wait() returns (or poll() says True) the bytes are in the peer's
memory, and the control plane's reply tells the decode side the blocks are complete.

A write cannot be recalled. When wait() times out the copy still finishes in the background, so
the receiver must keep the destination blocks out of use for a while (the engine's quarantine,
remote_kv_grace_s), as with NIXL. The transport keeps the memory an unfinished copy touches
mapped until the copy ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import operator
import os
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .shm_pool import IpcTransferError, ShmPool, host_id, map_fd, shared_kv_pool, shm_files, unlink_files

__all__ = ["IpcTransport", "IpcTransferError", "IpcWrite", "ShmPool", "host_id", "pool_tensors", "shared_kv_pool"]

# Bounds the gather buffer of one step of a write; large enough that a step's two kernels take
# far longer than their launches.
_CHUNK_BYTES = 256 << 20
_MAX_PEERS = 64
# On CUDA, up to this many runs of blocks are copied run by run (one copy kernel each, no gather
# buffer); more take the gather + scatter kernels, whose cost does not grow with the run count.
# On CPU runs are always copied one by one: there a run's copy is a memcpy per layer, several
# times faster than the element-wise index kernels.
_CUDA_MAX_RUNS = 8


def check_pool(owner: str, tensors: list[torch.Tensor], block_size: int, dims=(3,)) -> None:
    """The layout contract of a transport's pool (see the module docstring): contiguous
    [layers, num_slots(, width)] tensors on one device, num_slots a whole number of blocks."""
    if not tensors:
        raise ValueError(f"{owner} needs at least one tensor")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    shape = "[layers, num_slots(, width)]" if 2 in dims else "[layers, num_slots, width]"
    for i, t in enumerate(tensors):
        if t.dim() not in dims or not t.is_contiguous():
            raise ValueError(f"tensor {i} must be a contiguous {shape} tensor, "
                             f"got shape {tuple(t.shape)} contiguous={t.is_contiguous()}")
        if t.shape[1] != tensors[0].shape[1]:
            raise ValueError(f"tensor {i} has {t.shape[1]} slots, tensor 0 has {tensors[0].shape[1]}")
        # One copy (or NIXL descriptor list) per write serves one device and memory kind.
        if t.device != tensors[0].device:
            raise ValueError(f"tensor {i} is on {t.device}, tensor 0 on {tensors[0].device}")
    if tensors[0].shape[1] % block_size:
        raise ValueError(f"num_slots {tensors[0].shape[1]} is not a multiple of block_size {block_size}")


def pool_tensors(kv) -> list[torch.Tensor]:
    """The KV-cache tensors that move between engines (global KV, indexer keys, their FP8 scales)."""
    names = ("global_kv", "kv_scale", "index_keys", "index_scale")
    return [t for t in (getattr(kv, n, None) for n in names) if t is not None]


# -- transport -------------------------------------------------------------------------------------

@dataclass
class IpcWrite:
    """One write_blocks() call."""
    peer: str
    nbytes: int
    num_blocks: int
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    error: str | None = None
    _event: object | None = None    # torch.cuda.Event (CUDA) or Future (CPU); None when nothing to move
    _keep: tuple = ()               # tensors the copy touches: mapped until it ends

    @property
    def finished(self) -> bool:
        return self.done or self.error is not None

    def _copy_ended(self) -> bool:
        ev = self._event
        if ev is None:
            return True
        return ev.done() if isinstance(ev, Future) else ev.query()


_local_exports: "weakref.WeakValueDictionary[str, IpcTransport]" = weakref.WeakValueDictionary()
_STORAGE_DEVICE_ARG = None


def _rebuild_on(fn, args, device_index: int) -> torch.Tensor:
    """Rebuilds a CUDA-IPC reduced tensor, mapped into `device_index`'s context of this
    process. The exporter's device index means nothing here (each process numbers the GPUs it
    sees), and mapping into our own device's context is what lets our kernels store into the
    peer's memory (the driver enables peer access on open)."""
    global _STORAGE_DEVICE_ARG
    if _STORAGE_DEVICE_ARG is None:
        _STORAGE_DEVICE_ARG = list(inspect.signature(fn).parameters).index("storage_device")
    args = list(args)
    args[_STORAGE_DEVICE_ARG] = device_index
    return fn(*args)


def _word_view(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """[layers, num_blocks, words] over the same bytes, in the widest integer type that divides
    a block's row: a bit-exact copy with as few, as wide, stores as possible."""
    layers = t.shape[0]
    rows = t.reshape(layers, t.shape[1] // block_size, -1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if rows.shape[2] % torch.empty((), dtype=word).element_size() == 0:
            return rows.view(word)
    return rows


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of the maximal runs where both sides advance by one block
    together."""
    runs = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _layout(t: torch.Tensor) -> dict:
    return {"layers": t.shape[0], "num_slots": t.shape[1], "width": t.shape[2] if t.dim() == 3 else 0,
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


class IpcTransport:
    """Exports this engine's KV pool to same-host peers (metadata) and writes blocks into the
    pools of peers it has opened (connect / write_blocks); see the module docstring."""

    needs_notification = False  # completion is the writer's wait(); see the module docstring
    copy_mode = "auto"          # "runs" or "indexed" forces one way (tests, benchmarks)

    def __init__(self, name: str, tensors: list[torch.Tensor], block_size: int):
        check_pool("IpcTransport", tensors, block_size, dims=(2, 3))
        self.name = name
        self.block_size = block_size
        self.num_blocks = tensors[0].shape[1] // block_size
        self.device = tensors[0].device
        self._tensors = list(tensors)
        self._words = [_word_view(t, block_size) for t in tensors]
        self._block_bytes = sum(w.shape[0] * w.shape[2] * w.element_size() for w in self._words)
        self._lock = threading.Lock()
        self._meta: dict | None = None
        self._exported_files: list[str] = []
        self._peers: OrderedDict[str, dict] = OrderedDict()
        self._inflight: list[IpcWrite] = []   # writes whose copy may still run (incl. abandoned ones)
        self._stream = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self.writes = 0
        self.bytes_written = 0
        self._finalizer = weakref.finalize(self, unlink_files, self._exported_files)

    # -- export (the side whose pool is written) --------------------------------------------------

    def metadata(self) -> dict:
        """The picklable handle of this engine's pool; made on the first call, then reused."""
        with self._lock:
            self._check_open()
            if self._meta is None:
                try:
                    self._meta = self._export()
                except IpcTransferError:
                    raise
                except Exception as e:  # e.g. memory that CUDA IPC cannot share
                    raise IpcTransferError(f"{self.name}: cannot export the KV pool: {type(e).__name__}: {e}") from e
            return self._meta

    def _export(self) -> dict:
        export_id = uuid.uuid4().hex
        tensors = []
        for i, t in enumerate(self._tensors):
            entry = _layout(t)
            if t.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                fn, args = reduce_tensor(t)
                entry.update(kind="cuda", rebuild=fn, args=args)
            elif t.device.type == "cpu":
                f = shm_files.get(t.untyped_storage().data_ptr())
                if f is None or t.storage_offset() != 0 or t.numel() * t.element_size() != f.nbytes:
                    raise IpcTransferError(
                        f"{self.name}: KV tensor {i} is not a shared-memory pool file; build the engine "
                        f"inside engine.kv_ipc.shared_kv_pool() to export it")
                entry.update(kind="shm", path=f.path, inode=f.inode, st_dev=f.device, nbytes=f.nbytes)
                self._exported_files.append(f.path)
            else:
                raise IpcTransferError(f"{self.name}: cannot export {t.device} memory")
            tensors.append(entry)
        _local_exports[export_id] = self
        return {"transport": "ipc", "name": self.name, "export_id": export_id, "host": host_id(),
                "pid": os.getpid(), "block_size": self.block_size, "num_blocks": self.num_blocks,
                "tensors": tensors}

    # -- import (the writing side) ----------------------------------------------------------------

    def connect(self, peer: dict) -> str:
        """Opens the peer's pool (once; again only if the peer re-exported, e.g. restarted).
        Raises IpcTransferError when it is on another host, incompatible, or cannot be mapped."""
        name = peer.get("name", "?")
        with self._lock:
            self._check_open()
            known = self._peers.get(name)
            if known is not None and known["export_id"] == peer.get("export_id"):
                self._peers.move_to_end(name)
                return name
        if peer.get("transport") != "ipc":
            raise IpcTransferError(f"{self.name}: peer {name!r} sent no IPC handle")
        if peer["host"] != host_id():
            raise IpcTransferError(f"{self.name}: peer {name!r} is on host {peer['host']!r}, not this one "
                                   f"({host_id()!r}); use the NIXL transport across hosts")
        self._check_compatible(peer)
        tensors = self._open(peer)
        with self._lock:
            self._check_open()
            self._peers.pop(name, None)
            self._peers[name] = {"export_id": peer["export_id"], "num_blocks": peer["num_blocks"],
                                 "words": [_word_view(t, self.block_size) for t in tensors]}
            while len(self._peers) > _MAX_PEERS:  # forgotten peers (restarted ranks) unmap eventually
                self._peers.popitem(last=False)
        return name

    def _check_compatible(self, peer: dict) -> None:
        name = peer.get("name", "?")
        if peer["block_size"] != self.block_size:
            raise IpcTransferError(f"peer {name!r}: block_size {peer['block_size']} != local {self.block_size}")
        theirs = peer["tensors"]
        if len(theirs) != len(self._tensors):
            raise IpcTransferError(f"peer {name!r}: {len(theirs)} KV tensors != local {len(self._tensors)}")
        for i, (t, o) in enumerate(zip(theirs, map(_layout, self._tensors))):
            for key in ("layers", "width", "dtype"):
                if t[key] != o[key]:
                    raise IpcTransferError(f"peer {name!r}: tensor {i} {key} {t[key]} != local {o[key]}")
            kind = "cuda" if self.device.type == "cuda" else "shm"
            if t["kind"] != kind:
                raise IpcTransferError(f"peer {name!r}: its pool is {t['kind']} memory, ours is on {self.device}")

    def _open(self, peer: dict) -> list[torch.Tensor]:
        name = peer["name"]
        local = _local_exports.get(peer["export_id"]) if peer["pid"] == os.getpid() else None
        if local is not None:
            return list(local._tensors)
        out = []
        for i, t in enumerate(peer["tensors"]):
            dtype = getattr(torch, t["dtype"])
            try:
                if t["kind"] == "cuda":
                    index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                    m = _rebuild_on(t["rebuild"], t["args"], index)
                else:
                    fd = os.open(t["path"], os.O_RDWR)
                    try:
                        st = os.fstat(fd)
                        if (st.st_ino, st.st_dev) != (t["inode"], t["st_dev"]) or st.st_size < t["nbytes"]:
                            raise IpcTransferError(f"{t['path']} is not the file the peer exported")
                        raw = map_fd(fd, t["nbytes"])
                    finally:
                        os.close(fd)
                    m = raw.view(dtype).view(t["shape"])
            except IpcTransferError as e:
                raise IpcTransferError(f"{self.name}: cannot open peer {name!r} tensor {i}: {e}") from e
            except Exception as e:  # the handle is stale (peer gone) or the memory cannot be mapped here
                raise IpcTransferError(f"{self.name}: cannot open peer {name!r} tensor {i}: "
                                       f"{type(e).__name__}: {e}") from e
            if list(m.shape) != t["shape"] or m.dtype != dtype:
                raise IpcTransferError(f"{self.name}: peer {name!r} tensor {i} opened as {tuple(m.shape)} {m.dtype}")
            out.append(m)
        return out

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)

    # -- writes ------------------------------------------------------------------------------------

    def write_blocks(self, peer: str, src_blocks, dst_blocks, notif: bytes | None = None) -> IpcWrite:
        """Starts copying blocks src_blocks[i] -> the peer's dst_blocks[i]. `notif` is accepted
        for the NIXL transport's call shape and ignored."""
        if len(src_blocks) != len(dst_blocks):
            raise IpcTransferError(f"length mismatch: {len(src_blocks)} source blocks, "
                                   f"{len(dst_blocks)} destination blocks")
        with self._lock:
            self._check_open()
            self._prune()
            info = self._peers.get(peer)
            if info is None:
                raise IpcTransferError(f"{self.name}: unknown peer {peer!r} "
                                       f"(connect() it first; known: {sorted(self._peers)})")
            src = self._block_ids(src_blocks, self.num_blocks, "source", self.name)
            dst = self._block_ids(dst_blocks, info["num_blocks"], "destination", peer)
            if len(set(dst)) != len(dst):
                raise IpcTransferError(f"destination blocks repeat: {list(dst_blocks)}")
            handle = IpcWrite(peer, len(src) * self._block_bytes, len(src))
            if not src:
                handle.done = True
                return handle
            pairs = list(zip(self._words, info["words"]))
            handle._keep = tuple(d for _, d in pairs)
            try:
                if self.device.type == "cuda":
                    handle._event = self._copy_cuda(pairs, src, dst)
                else:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kv-ipc-{self.name}")
                    handle._event = self._executor.submit(self._copy, pairs, src, dst)
            except Exception as e:
                raise IpcTransferError(f"{self.name} -> {peer}: write of {len(src)} blocks failed to start: "
                                       f"{type(e).__name__}: {e}") from e
            self._inflight.append(handle)
            self.writes += 1
            self.bytes_written += handle.nbytes
            return handle

    def _chunks(self, n: int):
        step = max(1, _CHUNK_BYTES // self._block_bytes)
        return [(i, min(i + step, n)) for i in range(0, n, step)]

    @staticmethod
    def _copy_runs(pairs, runs) -> None:
        # One strided copy per run of blocks that advance together on both sides (all layers at
        # once): no gather buffer, memcpy speed when blocks come in runs.
        for s0, d0, n in runs:
            for s, d in pairs:
                d[:, d0:d0 + n].copy_(s[:, s0:s0 + n])

    def _copy_indexed(self, pairs, src: list[int], dst: list[int]) -> None:
        # A gather into a contiguous buffer and a scatter out of it, per chunk: two kernels
        # whatever the number of runs.
        ids = torch.tensor([src, dst], dtype=torch.long)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        for a, b in self._chunks(len(src)):
            for s, d in pairs:
                d.index_copy_(1, ids[1, a:b], s.index_select(1, ids[0, a:b]))

    def _copy(self, pairs, src: list[int], dst: list[int]) -> None:
        runs = _runs(src, dst)
        mode = self.copy_mode
        if mode == "auto":
            few = self.device.type == "cpu" or len(runs) <= _CUDA_MAX_RUNS
            mode = "runs" if few else "indexed"
        if mode == "runs":
            self._copy_runs(pairs, runs)
        else:
            self._copy_indexed(pairs, src, dst)

    def _copy_cuda(self, pairs, src: list[int], dst: list[int]):
        dev = self.device
        with torch.cuda.device(dev):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev)
            # The KV being sent was written by work already queued on the caller's stream.
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                self._copy(pairs, src, dst)
                event = torch.cuda.Event()
                event.record(self._stream)
        return event

    @staticmethod
    def _block_ids(blocks, num_blocks: int, side: str, owner: str) -> list[int]:
        try:
            ids = [operator.index(b) for b in blocks]
        except TypeError as e:
            raise IpcTransferError(f"{side} blocks must be a flat list of ints: {e}") from e
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise IpcTransferError(f"{side} block id(s) {bad} out of range: {owner!r} has blocks 0..{num_blocks - 1}")
        return ids

    def _prune(self) -> None:
        self._inflight = [h for h in self._inflight if not h._copy_ended()]

    def poll(self, handle: IpcWrite) -> bool:
        """Non-blocking: True once the bytes are in the peer's memory; raises IpcTransferError
        if the write failed, timed out or was cancelled."""
        if handle.error is not None:
            raise IpcTransferError(handle.error)
        if handle.done:
            return True
        if not handle._copy_ended():
            return False
        ev = handle._event
        err = ev.exception() if isinstance(ev, Future) else None
        if err is not None:
            handle.error = (f"{self.name} -> {handle.peer}: write of {handle.num_blocks} blocks failed: "
                            f"{type(err).__name__}: {err}")
            raise IpcTransferError(handle.error)
        handle.done = True
        handle._keep = ()
        return True

    def _timed_out(self, handle: IpcWrite, timeout_s: float) -> IpcTransferError:
        # The copy cannot be stopped: it stays in _inflight, its memory mapped, until it ends.
        handle.error = (f"{self.name} -> {handle.peer}: transfer of {handle.nbytes} bytes "
                        f"timed out after {timeout_s:g} s")
        return IpcTransferError(handle.error)

    def wait(self, handle: IpcWrite, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self.poll(handle):
            if time.monotonic() >= deadline:
                raise self._timed_out(handle, timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    async def wait_async(self, handle: IpcWrite, timeout_s: float, poll_s: float = 0.0005) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.poll(handle):
            if time.monotonic() >= deadline:
                raise self._timed_out(handle, timeout_s)
            await asyncio.sleep(poll_s)

    def cancel(self, handle: IpcWrite) -> None:
        """Gives the write up; bytes still being copied may land in the peer's blocks."""
        if not handle.finished:
            handle.error = f"{self.name} -> {handle.peer}: transfer cancelled"

    # -- lifetime ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise IpcTransferError(f"transport {self.name!r} is closed")

    def close(self) -> None:
        """Forgets the peers (after their unfinished copies end) and unlinks the pool files this
        side exported; the pool itself stays usable by its engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight, self._inflight = self._inflight, []
        for h in inflight:
            ev = h._event
            if isinstance(ev, Future):
                with contextlib.suppress(Exception):
                    ev.result()
            elif ev is not None:
                ev.synchronize()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        with self._lock:
            self._peers.clear()
            if self._meta is not None:
                _local_exports.pop(self._meta["export_id"], None)
        self._finalizer()

    def __enter__(self) -> "IpcTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
