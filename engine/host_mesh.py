"""The step's agreement of a group spread over several hosts (an NVL72 rack is 18 of them), on
the host as on one host, so that its ranks too can launch a step while the one before runs.

Each host's ranks meet in shared memory (`ShmExchange`). The host's lowest rank, its leader,
then sends the host's values to every other host's leader over TCP and reads theirs: one
round trip between hosts a step, where a gloo all-gather is a ring of H - 1 of them. The
leader writes the whole group's values into a second shared block, which the host's other
ranks wait on. Like the local block it tags every value with the step and keeps two buffers
by step parity; a leader cannot write step k + 2's values before its host's ranks have all
handed in step k + 2's, so none of them is still reading step k's.
"""
from __future__ import annotations

import os
import socket
import struct

import numpy as np

from .host_agreement import _TAG_MASK, _TAG_SHIFT, ShmExchange, _map_shared, _poll_until, _process_gone

_HEADER = struct.Struct("<qi")  # the step, then the payload's bytes


class LeaderMesh:
    """One TCP connection from this host's leader to each other host's leader."""

    def __init__(self, index: int, peers: dict[int, socket.socket], timeout_s: float):
        self.index, self.peers, self.timeout_s = index, peers, timeout_s
        for s in peers.values():
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.settimeout(timeout_s)

    @classmethod
    def connect(cls, index: int, addresses: list[tuple[str, int]], listener: socket.socket, token: bytes,
                timeout_s: float) -> "LeaderMesh":
        """Connect to the leaders before this one and accept those after it. Every listener is
        open before any leader connects (the addresses were gathered after listen()), so the
        connects complete whether or not their accept has run yet. `token` marks the group's
        own connections: anything else reaching the port is turned away."""
        peers = {}
        for j in range(index):
            try:
                s = socket.create_connection(addresses[j], timeout=timeout_s)
            except OSError as e:
                raise RuntimeError(f"the decode group's agreement: host {index}'s leader cannot reach host {j}'s "
                                   f"at {addresses[j][0]}:{addresses[j][1]} ({e}); the hosts' TCP ports must be "
                                   "open to each other") from None
            s.sendall(token + struct.pack("<i", index))
            peers[j] = s
        listener.settimeout(timeout_s)
        while len(peers) < len(addresses) - 1:
            try:
                s, _ = listener.accept()
            except socket.timeout:
                missing = [j for j in range(index + 1, len(addresses)) if j not in peers]
                raise RuntimeError(f"the decode group's agreement: the leaders of hosts {missing} did not connect "
                                   f"to host {index}'s in {timeout_s:.0f} s") from None
            s.settimeout(timeout_s)
            try:
                hello = _recv_exact(s, len(token) + 4)
            except OSError:
                hello = b""
            j = struct.unpack("<i", hello[len(token):])[0] if hello[:len(token)] == token else -1
            if not index < j < len(addresses) or j in peers:
                s.close()
                continue
            peers[j] = s
        listener.close()
        return cls(index, peers, timeout_s)

    def swap(self, step: int, payload: bytes) -> dict[int, bytes]:
        """Send `payload` to every other leader and return theirs of the same step, by index."""
        message = _HEADER.pack(step, len(payload)) + payload
        got, j = {}, None
        try:
            for j, s in self.peers.items():
                s.sendall(message)
            for j, s in self.peers.items():
                their_step, n = _HEADER.unpack(_recv_exact(s, _HEADER.size))
                if their_step != step:
                    raise RuntimeError(f"host {j} of the decode group sent step {their_step} at step {step}")
                got[j] = _recv_exact(s, n)
        except socket.timeout:
            raise RuntimeError(f"the leader of host {j} of the decode group did not reach step {step} "
                               f"in {self.timeout_s:.0f} s") from None
        except OSError as e:  # closed or reset: its process is gone
            raise RuntimeError(f"the leader of host {j} of the decode group is gone ({e})") from None
        return got

    def close(self) -> None:
        for s in self.peers.values():
            s.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


class HostsExchange:
    """One rank's end of the agreement over several hosts. `ranks_of_host[h]` are the group's
    ranks on host h, lowest first (the first its leader); `local` is this host's shared block
    and `result_path` names the host's block of the whole group's values."""

    def __init__(self, rank: int, world: int, width: int, ranks_of_host: list[list[int]], local: ShmExchange,
                 result_path: str, create: bool, leader: bool, timeout_s: float = 120.0):
        self.rank, self.world, self.width, self.timeout_s = rank, world, width, timeout_s
        self.ranks_of_host, self.local, self.leader = ranks_of_host, local, leader
        self.mesh: LeaderMesh | None = None  # the leader's, set once every leader listens
        self.host = next(h for h, ranks in enumerate(ranks_of_host) if rank in ranks)
        self.path = result_path
        self.map = _map_shared(result_path, 2 * world * width * 8, create)
        self.result = np.ndarray((2, world, width), dtype=np.int64, buffer=self.map)
        self.step = 0

    def exchange(self, values: list[int]) -> list[list[int]]:
        here = self.local.exchange(values)  # validates the values; this host's ranks, in order
        self.step += 1
        tag = (self.step & _TAG_MASK) << _TAG_SHIFT
        view = self.result[self.step % 2]
        if self.leader:
            rows = np.empty((self.world, self.width), dtype=np.int64)
            rows[self.ranks_of_host[self.host]] = here
            payload = np.asarray(here, dtype=np.int64).tobytes()
            for h, body in self.mesh.swap(self.step, payload).items():
                rows[self.ranks_of_host[h]] = np.frombuffer(body, dtype=np.int64).reshape(-1, self.width)
            view[:] = rows | tag
            return rows.tolist()
        _poll_until(lambda: ((view >> _TAG_SHIFT) == (tag >> _TAG_SHIFT)).all(), self._check_leader)
        return (view & ((1 << _TAG_SHIFT) - 1)).tolist()

    def _check_leader(self, waited: float) -> None:
        leader, pid = self.ranks_of_host[self.host][0], int(self.local.slots[0, 0])
        if _process_gone(pid):
            raise RuntimeError(f"rank {leader} of the decode group (pid {pid}), this host's leader, is gone")
        if waited > self.timeout_s:
            raise RuntimeError(f"rank {leader} of the decode group, this host's leader, did not bring step "
                               f"{self.step} in {self.timeout_s:.0f} s")

    def unlink(self) -> None:
        os.unlink(self.path)
