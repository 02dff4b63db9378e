"""The step's agreement of a lockstep group on the host, off the GPU's stream (engine/ep.py,
`ExpertParallel.agree`): every rank hands in a few small integers and gets every rank's back.

- `ShmExchange`: the ranks of one host, through a shared-memory block: each rank writes its
  values into its own cache lines and spins until every rank's are there, microseconds.
- `HostsExchange` (engine/host_mesh.py): ranks of several hosts (an NVL72 rack is 18 of them):
  shared memory on each host, one TCP round trip between the hosts' leaders.
- `GlooExchange`: an all-gather over a gloo group, the form of CPU groups (whose forward group
  is gloo anyway). Its latency grows with the group (a ring of round trips: 0.19 ms at 2 ranks,
  0.83 ms at 8 on one host, bench/agree_latency.py), which is why GPU groups use the others.

Each value of the shared block carries the step's tag in its high bits, so a reader never
needs the writer's stores to arrive in order (weakly ordered CPUs included): an aligned
8-byte store is seen whole or not at all. Two buffers per rank, by step parity: a rank can
run at most one agreement ahead of the slowest (it cannot pass step k + 1 before every rank
has written it, that is, finished reading step k), so it never overwrites what a slower
rank is still reading.
"""
from __future__ import annotations

import mmap
import os
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

# Newer torch names the tensor form of the all-gather all_gather_single (the old name warns).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_TAG_SHIFT = 40                 # values below 2**40; the step's tag above
_TAG_MASK = (1 << 23) - 1       # tags wrap: ranks are never 2**23 steps apart
_SLOT = 16                      # int64s per rank: its pid, then two buffers (128 bytes)


class GlooExchange:
    """The exchange as an all-gather over a gloo group (CPU groups)."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world

    def exchange(self, values: list[int]) -> list[list[int]]:
        every = torch.empty(self.world * len(values), dtype=torch.long)  # concatenated in rank order
        _all_gather(every, torch.tensor(values, dtype=torch.long), group=self.group)
        return every.view(self.world, len(values)).tolist()


class ShmExchange:
    """One rank's end of a shared block of `world` slots, a file under /dev/shm. Rank 0 makes it
    (`create`), the others open it by path; the path can be unlinked once all have it mapped."""

    def __init__(self, path: str, rank: int, world: int, width: int, create: bool, timeout_s: float = 120.0,
                 group_ranks: list[int] | None = None):
        """group_ranks: the decode group's rank of each slot, for errors (a host's block of a
        group over several hosts holds only that host's ranks)."""
        if 1 + 2 * width > _SLOT:
            raise ValueError(f"a slot holds {(_SLOT - 1) // 2} values, not {width}")
        self.path, self.rank, self.world, self.width, self.timeout_s = path, rank, world, width, timeout_s
        self.group_ranks = group_ranks or list(range(world))
        self.map = _map_shared(path, world * _SLOT * 8, create)
        self.slots = np.ndarray((world, _SLOT), dtype=np.int64, buffer=self.map)
        self.slots[rank, 0] = os.getpid()
        self.step = 0

    def exchange(self, values: list[int]) -> list[list[int]]:
        if len(values) != self.width or any(v < 0 or v >> _TAG_SHIFT for v in values):
            raise ValueError(f"{self.width} values in 0..2**{_TAG_SHIFT} expected, got {values}")
        self.step += 1
        tag = (self.step & _TAG_MASK) << _TAG_SHIFT
        first = 1 + (self.step % 2) * self.width
        view = self.slots[:, first:first + self.width]
        view[self.rank] = [tag | v for v in values]
        self._wait(view, tag)
        return (view & ((1 << _TAG_SHIFT) - 1)).tolist()

    def _wait(self, view: np.ndarray, tag: int) -> None:
        _poll_until(lambda: ((view >> _TAG_SHIFT) == (tag >> _TAG_SHIFT)).all(),
                    lambda waited: self._check_peers(view, tag, waited))

    def _check_peers(self, view: np.ndarray, tag: int, waited: float) -> None:
        late = [r for r in range(self.world) if (view[r] >> _TAG_SHIFT != tag >> _TAG_SHIFT).any()]
        for r in late:
            pid = int(self.slots[r, 0])
            if _process_gone(pid):
                raise RuntimeError(f"rank {self.group_ranks[r]} of the decode group (pid {pid}) is gone")
        if waited > self.timeout_s:
            raise RuntimeError(f"ranks {[self.group_ranks[r] for r in late]} of the decode group did not reach "
                               f"step {self.step} in {self.timeout_s:.0f} s")

    def unlink(self) -> None:
        """Remove the file; the mapping stays until the last view of it is gone (closing the map
        explicitly would leave numpy views pointing at unmapped memory)."""
        os.unlink(self.path)


def _map_shared(path: str, nbytes: int, create: bool) -> mmap.mmap:
    """Map a shared block: a new zero-filled file (`create`, which must not exist) or another's."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _process_gone(pid: int) -> bool:
    """Whether the process of this pid (a peer's on this host; 0: not yet known) has ended."""
    try:
        if pid:
            os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _poll_until(done, check) -> None:
    """Spin for about 0.2 ms, then poll every ~50 us; every ~10 ms `check(seconds waited)`
    raises if the wait is hopeless (a peer gone, the timeout passed)."""
    start = time.monotonic()
    spins = 0
    while not done():
        spins += 1
        if spins < 200:
            continue
        time.sleep(5e-5)
        if spins % 200 == 0:
            check(time.monotonic() - start)


def host_exchange(rank: int, world: int, width: int, gloo_group, timeout_s: float = 120.0,
                  address: str | None = None):
    """The group's exchange on the host: shared memory when every rank is on this host; across
    hosts, shared memory per host and one TCP round trip between the hosts' leaders
    (engine/host_mesh.py), which listen on `address` (this host's address the others reach;
    by default what its host name resolves to). The blocks' names and the leaders' addresses
    are handed round over `gloo_group`. Collective: every rank calls it."""
    from .host_mesh import HostsExchange, LeaderMesh
    from .shm_pool import SHM_DIR, host_id

    hosts = [None] * world
    dist.all_gather_object(hosts, host_id(), group=gloo_group)
    names = list(dict.fromkeys(hosts))  # rank 0's host first, and rank 0 its leader
    ranks_of_host = [[r for r in range(world) if hosts[r] == h] for h in names]
    host = names.index(hosts[rank])
    mine = ranks_of_host[host]
    leader, multi = rank == mine[0], len(names) > 1
    offer, listener, whole = None, None, None
    if leader:  # each host's leader makes its host's blocks (and listens for the other leaders)
        stem = f"{SHM_DIR}/wideep-agree-{uuid.uuid4().hex}"
        local = ShmExchange(stem, 0, len(mine), width, create=True, timeout_s=timeout_s, group_ranks=mine)
        offer = (stem, None, uuid.uuid4().bytes)
        if multi:
            whole = HostsExchange(rank, world, width, ranks_of_host, local, stem + "-all", create=True,
                                  leader=True, timeout_s=timeout_s)
            listener = socket.create_server((address or socket.gethostbyname(socket.gethostname()), 0))
            offer = (stem, listener.getsockname()[:2], offer[2])
    offers = [None] * world
    dist.all_gather_object(offers, offer, group=gloo_group)
    stem = offers[mine[0]][0]
    if not leader:
        local = ShmExchange(stem, mine.index(rank), len(mine), width, create=False, timeout_s=timeout_s,
                            group_ranks=mine)
        if multi:
            whole = HostsExchange(rank, world, width, ranks_of_host, local, stem + "-all", create=False,
                                  leader=False, timeout_s=timeout_s)
    elif multi:
        whole.mesh = LeaderMesh.connect(host, [offers[ranks[0]][1] for ranks in ranks_of_host], listener,
                                        offers[0][2], timeout_s)
    dist.barrier(group=gloo_group)
    if leader:  # every rank has them open: nothing left behind in /dev/shm, whatever happens next
        local.unlink()
        if multi:
            whole.unlink()
    return whole if multi else local
