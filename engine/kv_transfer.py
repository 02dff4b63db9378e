"""KV block transport between engines over NIXL (no Ray here: the control plane that carries
metadata and block ids between prefill and decode lives above the engine).

Layout contract: every registered tensor is [layers, num_slots, width] and contiguous, with
num_slots = num_blocks * block_size, so block b of layer l is one contiguous byte range
tensor[l, b*block_size:(b+1)*block_size]. Both sides must agree on the number of tensors and on
each tensor's layers, width and dtype and on block_size; pool sizes (num_slots) may differ.

Protocol: the decode side allocates blocks, sends their ids to the prefill side, and waits for a
notification; the prefill side calls write_blocks(...) with that notification and wait()s. NIXL
delivers the notification only after the written bytes have landed, so a received notification
means the destination blocks are complete.

Caveat for callers that give up early: NIXL offers no receiver-side cancel. A write that the
sender has not yet been told to abandon can still land after the receiver's wait_notification
timed out, so the receiver must not hand those blocks to another sequence until either the
notification arrives or the sender reports (through the control plane) that its wait() raised —
wait() releases the request, which makes NIXL cancel it, before raising.

Progress: a UCX write only advances while *both* agents' workers are progressed (connection
set-up, and the data itself when UCX picks a transport that needs the target's help, as it does
between processes here). NIXL's own progress thread does that but spins a whole core even when
idle, so each transport runs a small throttled progress thread instead: fast while a write is in
flight or someone waits for a notification, slow otherwise. The same thread collects arrived
notifications and finished writes, so the blocking waits sleep on a condition variable.

Threading: every method may be called from any thread (callers are asyncio code using
asyncio.to_thread), and wait_async / wait_notification_async poll from the event loop without a
thread. One lock serialises all use of the agent, whose default thread-sync mode assumes a
single caller.
"""

from __future__ import annotations

import asyncio
import operator
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from .kv_ipc import check_pool, pool_tensors

__all__ = ["KVTransport", "TransferError", "TransferHandle"]

# Progress-thread periods. Fast: short against the time a block write takes, while costing a few
# percent of a core. Slow: only keeps idle connections answering peers that start talking to us,
# a few ms of extra latency on a peer's first request is harmless.
_FAST_S = 0.0002
_IDLE_S = 0.005


class TransferError(RuntimeError):
    """A transfer (or its set-up) failed, was refused as invalid, or timed out."""


@dataclass
class TransferHandle:
    peer: str
    notif: bytes
    nbytes: int
    num_descs: int
    started: float = field(default_factory=time.monotonic)
    # None once released, and from the start when there was nothing to move (empty block list)
    _xfer: object | None = None
    done: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.done or self.error is not None


def _progress_loop(ref: "weakref.ref[KVTransport]") -> None:
    # Holds only a weak reference between rounds so a forgotten transport can still be collected.
    while True:
        t = ref()
        if t is None or t._closed:
            return
        with t._lock:
            if t._closed:
                return
            t._progress_locked()
            busy = bool(t._live_handles) or t._waiters > 0
        wake = t._wake
        del t
        wake.wait(_FAST_S if busy else _IDLE_S)
        wake.clear()

def transfer_tensors(kv) -> list[torch.Tensor]:
    """The KV-cache tensors that move between engines (global KV, its FP8 scales, indexer keys),
    each as a [layers, slots, width] view: the per-token FP8 scales travel as width 1."""
    return [t if t.dim() == 3 else t.unsqueeze(-1) for t in pool_tensors(kv)]


def _layout(t: torch.Tensor) -> dict:
    return {
        "address": t.data_ptr(),
        "layers": t.shape[0],
        "num_slots": t.shape[1],
        "width": t.shape[2],
        "element_size": t.element_size(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "memory": "DRAM" if t.device.type == "cpu" else "VRAM",
        "device_id": 0 if t.device.type == "cpu" else t.device.index,
    }


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src_start, dst_start, length) of the maximal runs where both sides advance by one
    block together, so a run is one descriptor per (tensor, layer) instead of one per block."""
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(src)))
    return src[starts], dst[starts], lengths


def _descs(layouts: list[dict], block_size: int, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Nx3 (address, length, device id) rows, ordered tensor-major, then layer, then run — the
    same order on both sides, which is what pairs each local row with its remote row."""
    rows = []
    for lay in layouts:
        block_bytes = block_size * lay["width"] * lay["element_size"]
        layer_bytes = lay["num_slots"] * lay["width"] * lay["element_size"]
        layer_base = lay["address"] + np.arange(lay["layers"], dtype=np.uint64)[:, None] * np.uint64(layer_bytes)
        addr = layer_base + (starts.astype(np.uint64) * np.uint64(block_bytes))[None, :]
        length = np.broadcast_to(lengths.astype(np.uint64) * np.uint64(block_bytes), addr.shape)
        dev = np.full(addr.shape, lay["device_id"], dtype=np.uint64)
        rows.append(np.stack([addr.ravel(), length.ravel(), dev.ravel()], axis=1))
    return np.ascontiguousarray(np.concatenate(rows), dtype=np.uint64)


class KVTransport:
    """One NIXL agent owning an engine's KV pool registration; see the module docstring."""

    def __init__(self, name: str, tensors: list[torch.Tensor], block_size: int, backends=("UCX",),
                 nixl_progress_thread: bool = False):
        """nixl_progress_thread=True uses NIXL's own (spinning) progress thread in addition to
        ours; only worth it where a core per agent is cheap and latency matters more."""
        check_pool("KVTransport", tensors, block_size)

        self.name = name
        self.block_size = block_size
        self.num_blocks = tensors[0].shape[1] // block_size
        self.backends = list(backends)
        # Kept so the registered memory cannot be freed under NIXL while this object lives.
        self._tensors = list(tensors)
        self._layouts = [_layout(t) for t in tensors]
        self._mem = self._layouts[0]["memory"]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # signalled when writes finish or notifs arrive
        self._wake = threading.Event()  # switches the progress thread to its fast period at once
        self._waiters = 0
        self._peers: dict[str, dict] = {}
        self._pending_notifs: list[bytes] = []
        self._discarded: set[bytes] = set()
        self._live_handles: dict[int, TransferHandle] = {}  # released by close() if still in flight
        self._closed = False
        try:
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=nixl_progress_thread,
                                                             backends=self.backends))
            missing = [b for b in self.backends if b not in self._agent.backends]
            if missing:
                raise TransferError(f"NIXL backend(s) {missing} unavailable; plugins: {self._agent.get_plugin_list()}")
            self._reg = self._agent.register_memory(self._tensors)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"agent {name!r}: NIXL set-up failed: {type(e).__name__}: {e}") from e
        if self._reg is None:
            raise TransferError(f"agent {name!r}: NIXL refused to register the KV tensors")
        self._thread = threading.Thread(target=_progress_loop, args=(weakref.ref(self),),
                                        name=f"kv-transfer-{name}", daemon=True)
        self._thread.start()

    # -- peers ---------------------------------------------------------------------------------

    def metadata(self) -> dict:
        with self._lock:
            self._check_open()
            return {
                "name": self.name,
                "agent_metadata": self._agent.get_agent_metadata(),
                "block_size": self.block_size,
                "num_blocks": self.num_blocks,
                "tensors": [dict(lay) for lay in self._layouts],
            }

    def connect(self, peer: dict) -> str:
        name = peer["name"]
        self._check_compatible(peer)
        with self._lock:
            self._check_open()
            known = self._peers.get(name)
            if known is not None and known["agent_metadata"] == peer["agent_metadata"]:
                return name
            try:
                if known is not None:
                    # Same name, new metadata: the peer restarted; the old endpoint is dead.
                    self._agent.remove_remote_agent(name)
                    del self._peers[name]
                added = self._agent.add_remote_agent(peer["agent_metadata"])
            except Exception as e:
                raise TransferError(f"{self.name}: cannot add peer {name!r}: {type(e).__name__}: {e}") from e
            added = added.decode() if isinstance(added, bytes) else added
            if added != name:
                raise TransferError(f"{self.name}: peer metadata names agent {added!r} but the layout says {name!r}")
            self._peers[name] = peer
            return name

    def disconnect(self, peer: str) -> None:
        with self._lock:
            if self._peers.pop(peer, None) is not None and not self._closed:
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass  # the peer is being forgotten either way

    def _check_compatible(self, peer: dict) -> None:
        name = peer.get("name", "?")
        if peer["block_size"] != self.block_size:
            raise TransferError(f"peer {name!r}: block_size {peer['block_size']} != local {self.block_size}")
        theirs, ours = peer["tensors"], self._layouts
        if len(theirs) != len(ours):
            raise TransferError(f"peer {name!r}: {len(theirs)} KV tensors != local {len(ours)}")
        for i, (t, o) in enumerate(zip(theirs, ours)):
            for key in ("layers", "width", "element_size", "dtype"):
                if t[key] != o[key]:
                    raise TransferError(f"peer {name!r}: tensor {i} {key} {t[key]} != local {o[key]}")

    # -- sender side ---------------------------------------------------------------------------

    def write_blocks(self, peer: str, src_blocks: list[int], dst_blocks: list[int], notif: bytes) -> TransferHandle:
        if not isinstance(notif, bytes):
            raise TransferError(f"notif must be bytes, got {type(notif).__name__}")
        if len(src_blocks) != len(dst_blocks):
            raise TransferError(f"length mismatch: {len(src_blocks)} source blocks, {len(dst_blocks)} destination blocks")
        with self._lock:
            self._check_open()
            info = self._peers.get(peer)
            if info is None:
                raise TransferError(f"{self.name}: unknown peer {peer!r} (connect() it first; known: {sorted(self._peers)})")
            src = self._block_ids(src_blocks, self.num_blocks, "source", self.name)
            dst = self._block_ids(dst_blocks, info["num_blocks"], "destination", peer)
            if len(np.unique(dst)) != len(dst):
                raise TransferError(f"destination blocks repeat: {list(dst_blocks)}")
            if len(src) == 0:
                # Nothing to move, but the receiver still waits for its notification.
                try:
                    self._agent.send_notif(peer, notif)
                except Exception as e:
                    raise TransferError(f"{self.name} -> {peer}: notification failed: {type(e).__name__}: {e}") from e
                return TransferHandle(peer, notif, 0, 0, done=True)

            s_start, d_start, lengths = _runs(src, dst)
            local = _descs(self._layouts, self.block_size, s_start, lengths)
            remote = _descs(info["tensors"], self.block_size, d_start, lengths)
            nbytes = int(local[:, 1].sum())
            xfer = None
            try:
                xfer = self._agent.initialize_xfer(
                    "WRITE", self._agent.get_xfer_descs(local, self._mem),
                    self._agent.get_xfer_descs(remote, info["tensors"][0]["memory"]), peer, notif, self.backends)
                state = self._agent.transfer(xfer)
            except Exception as e:
                self._release(xfer)
                why = ("peer disconnected (its process is gone or closed its transport)"
                       if "REMOTE_DISCONNECT" in str(e) else f"{type(e).__name__}: {e}")
                raise TransferError(f"{self.name} -> {peer}: write of {len(src)} blocks failed to start: {why}") from e
            if state == "ERR":
                self._release(xfer)
                raise TransferError(f"{self.name} -> {peer}: write of {len(src)} blocks failed to start")
            handle = TransferHandle(peer, notif, nbytes, len(local), _xfer=xfer, done=state == "DONE")
            if state == "DONE":
                self._release(xfer)
                handle._xfer = None
            else:
                self._live_handles[id(handle)] = handle
                self._wake.set()
            return handle

    @staticmethod
    def _block_ids(blocks, num_blocks: int, side: str, owner: str) -> np.ndarray:
        try:
            ids = np.asarray([operator.index(b) for b in blocks], dtype=np.int64)
        except TypeError as e:
            raise TransferError(f"{side} blocks must be a flat list of ints: {e}") from e
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        if len(bad):
            raise TransferError(f"{side} block id(s) {bad.tolist()} out of range: {owner!r} has blocks 0..{num_blocks - 1}")
        return ids


    def poll(self, handle: TransferHandle) -> bool:
        """Non-blocking: True once the write completed, False while it is in flight; raises
        TransferError if it failed. Makes progress itself, so a caller polling faster than the
        progress thread is not held back by it."""
        with self._lock:
            if not handle.finished and not self._closed:
                self._progress_locked()
            return self._outcome(handle)

    def _outcome(self, handle: TransferHandle) -> bool:
        if handle.error is not None:
            raise TransferError(handle.error)
        if handle.done:
            return True
        if self._closed:
            raise TransferError(f"transport {self.name!r} closed while the write to {handle.peer} was in flight")
        return False

    def _timed_out(self, handle: TransferHandle, timeout_s: float) -> TransferError:
        self._finish(handle)
        handle.error = (f"{self.name} -> {handle.peer}: transfer of {handle.nbytes} bytes "
                        f"timed out after {timeout_s:g} s")
        return TransferError(handle.error)

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        # NIXL offers no blocking wait: the progress thread polls and signals the condition. The
        # deadline also covers a peer whose death the backend never notices (state stays PROC).
        with self._cond:
            if not self._cond.wait_for(lambda: handle.finished or self._closed, timeout_s):
                raise self._timed_out(handle, timeout_s)
            self._outcome(handle)

    async def wait_async(self, handle: TransferHandle, timeout_s: float, poll_s: float = 0.001) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.poll(handle):
            if time.monotonic() >= deadline:
                with self._lock:
                    raise self._timed_out(handle, timeout_s)
            await asyncio.sleep(poll_s)

    def cancel(self, handle: TransferHandle) -> None:
        """Abandon a write: releasing an in-flight NIXL request asks the backend to abort it."""
        with self._lock:
            if not handle.finished:
                self._finish(handle)
                handle.error = f"{self.name} -> {handle.peer}: transfer cancelled"

    def _progress_locked(self) -> None:
        changed = False
        try:
            new = self._agent.get_new_notifs()
        except Exception:
            new = {}  # a transient backend error here must not kill the progress thread
        for msgs in new.values():
            for msg in msgs:
                changed = True
                if msg in self._discarded:
                    self._discarded.discard(msg)
                else:
                    self._pending_notifs.append(msg)
        for handle in list(self._live_handles.values()):
            try:
                state = self._agent.check_xfer_state(handle._xfer)
            except Exception as e:
                state, detail = "ERR", f"{type(e).__name__}: {e}"
            else:
                detail = "peer gone or its memory no longer registered"
            if state == "PROC":
                continue
            changed = True
            self._finish(handle)
            if state == "DONE":
                handle.done = True
            else:
                handle.error = f"{self.name} -> {handle.peer}: transfer of {handle.nbytes} bytes failed ({detail})"
        if changed:
            self._cond.notify_all()

    def _finish(self, handle: TransferHandle) -> None:
        self._live_handles.pop(id(handle), None)
        self._release(handle._xfer)
        handle._xfer = None

    def _release(self, xfer) -> None:
        if xfer is None:
            return
        try:
            xfer.release()
        except Exception:
            # NIXL could not abort it; the handle's finaliser parks it on the agent's leak list,
            # which the agent retries when it is destroyed.
            pass

    # -- receiver side -------------------------------------------------------------------------

    def _take(self, notif: bytes) -> bool:
        try:
            self._pending_notifs.remove(notif)
            return True
        except ValueError:
            return False

    def check_notification(self, notif: bytes) -> bool:
        """Non-blocking: True (and consumed) if notif has arrived; others are kept for later."""
        with self._lock:
            self._check_open()
            if self._take(notif):
                return True
            self._progress_locked()
            return self._take(notif)

    def wait_notification(self, notif: bytes, timeout_s: float) -> bool:
        with self._cond:
            self._check_open()
            self._waiters += 1
            self._wake.set()
            try:
                return self._cond.wait_for(lambda: self._closed or notif in self._pending_notifs,
                                           timeout_s) and self._take(notif)
            finally:
                self._waiters -= 1

    async def wait_notification_async(self, notif: bytes, timeout_s: float, poll_s: float = 0.001) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._waiters += 1  # keeps the progress thread fast; the checks below do no NIXL call
        self._wake.set()
        try:
            while True:
                with self._lock:
                    self._check_open()
                    if self._take(notif):
                        return True
                if time.monotonic() >= deadline:
                    return False
                await asyncio.sleep(poll_s)
        finally:
            with self._lock:
                self._waiters -= 1

    def discard_notification(self, notif: bytes) -> None:
        """The caller no longer waits for notif (its transfer was abandoned): drop it now if it has
        arrived, or when it arrives, so late notifications do not pile up."""
        with self._lock:
            if not self._take(notif):
                self._discarded.add(notif)

    # -- lifetime ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transport {self.name!r} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            for handle in list(self._live_handles.values()):
                self._finish(handle)
            for peer in list(self._peers):
                try:
                    self._agent.remove_remote_agent(peer)
                except Exception:
                    pass  # a dead peer cannot object to being forgotten
            self._peers.clear()
            try:
                self._agent.deregister_memory(self._reg)
            finally:
                self._agent = None  # the agent (and its UCX workers) is torn down with the object
                self._tensors = []

    def __enter__(self) -> "KVTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
