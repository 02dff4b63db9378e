"""Shared-memory KV pools for the same-host transport on CPU (engine/kv_ipc.py): the pool
tensors live in files under /dev/shm that another process of this host maps, so the CPU path
runs the same transport code as CUDA IPC between GPUs. Files are unlinked when their pool is
closed, by a finaliser at exit, or after a crash by the next pool made on this host once the
process that made them is gone.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import socket
import threading
import uuid
import weakref
from dataclasses import dataclass

import torch

from .model_runner import KV_POOL_ALLOCATOR

SHM_DIR = "/dev/shm"
_PREFIX = "wideep-kv-"


class IpcTransferError(RuntimeError):
    """A transfer (or opening a peer's pool) failed, was refused as invalid, or timed out."""


def host_id() -> str:
    """Names this machine for "are we on the same host": the host name and this boot. Two
    containers on one machine usually differ in host name, and their /dev/shm and CUDA IPC may
    not be shared, so they count as different hosts."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def host_tag() -> str:
    return hashlib.sha1(host_id().encode()).hexdigest()[:8]


@dataclass(frozen=True)
class _ShmFile:
    path: str
    inode: int
    device: int
    nbytes: int


shm_files: dict[int, _ShmFile] = {}  # data_ptr of a pool tensor made here -> its file
_owned: set[str] = set()               # files this process made and has not unlinked yet
_owned_lock = threading.Lock()


def unlink_files(paths) -> None:
    for p in list(paths):
        with _owned_lock:
            _owned.discard(p)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


@atexit.register
def _unlink_owned() -> None:
    unlink_files(set(_owned))


def map_fd(fd: int, nbytes: int) -> torch.Tensor:
    # Through the descriptor, not the name: a name unlinked meanwhile must fail the open rather
    # than have torch create (and grow) a fresh file under it.
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str) -> None:
    """Unlinks pool files of this host whose process is gone (killed before its finaliser ran).
    Only names with this host's tag are considered, so another machine's or container's files
    sharing the directory are left alone."""
    mine = f"{_PREFIX}{host_tag()}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not name.startswith(mine):
                continue
            try:
                pid = int(name[len(mine):].split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not _alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


class ShmPool:
    """A KVCache allocator (see engine.model_runner.KV_POOL_ALLOCATOR) that moves the CPU pool
    tensors into files under `directory`, so another process on this host can map them. CUDA
    tensors are returned as they are: their memory is exported by CUDA IPC."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.paths: list[str] = []
        self._swept = False

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            return t
        if not self._swept:
            sweep_stale(self.directory)
            self._swept = True
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        path = os.path.join(self.directory, f"{_PREFIX}{host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with _owned_lock:
            _owned.add(path)
        try:
            # Reserve the pages now: a tmpfs that is too small then fails here, not with a
            # SIGBUS on the first touch of a page it cannot back.
            os.posix_fallocate(fd, 0, max(nbytes, 1))
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            unlink_files([path])
            raise IpcTransferError(f"cannot place the {name} KV pool ({nbytes} bytes) in {self.directory}: {e}") from e
        try:
            raw = map_fd(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        out = raw[:nbytes].view(t.dtype).view(t.shape)
        out.copy_(t)
        key = out.untyped_storage().data_ptr()
        shm_files[key] = _ShmFile(path, st.st_ino, st.st_dev, nbytes)
        weakref.finalize(out, shm_files.pop, key, None)
        self.paths.append(path)
        return out

    def close(self) -> None:
        """Unlinks the files (mappings already made, here or elsewhere, stay valid)."""
        unlink_files(self.paths)


@contextlib.contextmanager
def shared_kv_pool(directory: str = SHM_DIR):
    """Engines built inside this block keep their transferable KV pool in shared memory files
    (CPU) that an IpcTransport can export. Yields the ShmPool."""
    pool = ShmPool(directory)
    token = KV_POOL_ALLOCATOR.set(pool)
    try:
        yield pool
    finally:
        KV_POOL_ALLOCATOR.reset(token)
