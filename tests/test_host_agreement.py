"""The step's agreement on the host (engine/host_agreement.py): shared memory between the ranks of
one host, gloo otherwise; run in spawned processes, as a decode group's ranks are."""
import multiprocessing as mp
import os
import queue
import random
import socket
import time

import pytest

from engine.host_agreement import GlooExchange, ShmExchange, host_exchange


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _values(rank, step):
    return [rank, step, (rank * 7919 + step * 104729) % 1000, 1 << 39, 0, step % 2]


def _exchanger(path, rank, world, steps, results):
    """Exchange `steps` times at an uneven pace (a rank sometimes a whole step behind), checking
    every rank's values each time."""
    ex = ShmExchange(path, rank, world, 6, create=False)
    rng = random.Random(rank)
    bad = []
    for step in range(1, steps + 1):
        if rng.random() < 0.1:
            time.sleep(rng.random() * 2e-3)
        got = ex.exchange(_values(rank, step))
        if got != [_values(r, step) for r in range(world)]:
            bad.append((step, got))
    results.put((rank, bad[:3]))


def test_shared_memory_exchange_hands_every_rank_every_value(tmp_path):
    world, steps = 3, 300
    path = str(tmp_path / "agree")
    maker = ShmExchange(path, 0, world, 6, create=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_exchanger, args=(path, r, world, steps, results)) for r in range(1, world)]
    for p in procs:
        p.start()
    rng, bad = random.Random(0), []
    for step in range(1, steps + 1):
        if rng.random() < 0.1:
            time.sleep(rng.random() * 2e-3)
        got = maker.exchange(_values(0, step))
        if got != [_values(r, step) for r in range(world)]:
            bad.append((step, got))
    others = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    assert bad == [] and others == {1: [], 2: []}


def _exchange_then(path, rank, then, results):
    ex = ShmExchange(path, rank, 2, 6, create=False)
    ex.exchange([1] * 6)
    results.put("exchanged")
    results.close()
    results.join_thread()  # delivered before the process ends
    if then == "exit":
        os._exit(0)
    time.sleep(30)  # alive, never at the next step


@pytest.mark.parametrize("then,message", [("exit", "is gone"), ("stall", "did not reach step 2")])
def test_a_rank_that_is_gone_or_stuck_fails_the_wait(tmp_path, then, message):
    """The survivor's wait ends with an error naming the rank: at once when its process is gone,
    after the timeout when it is alive but never comes."""
    path = str(tmp_path / "agree")
    ex = ShmExchange(path, 0, 2, 6, create=True)  # the peer's start takes seconds
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    peer = ctx.Process(target=_exchange_then, args=(path, 1, then, results))
    peer.start()
    try:
        assert ex.exchange([0] * 6) == [[0] * 6, [1] * 6]
        assert results.get(timeout=30) == "exchanged"
        ex.timeout_s = 1.0
        if then == "exit":
            peer.join(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=message):
            ex.exchange([0] * 6)
        assert time.monotonic() - t0 < 10
    finally:
        peer.kill()
        peer.join(timeout=10)


def test_values_out_of_range_are_refused(tmp_path):
    ex = ShmExchange(str(tmp_path / "agree"), 0, 1, 6, create=True)
    for values in ([0] * 5, [-1, 0, 0, 0, 0, 0], [1 << 40, 0, 0, 0, 0, 0]):
        with pytest.raises(ValueError, match="6 values"):
            ex.exchange(values)
    assert ex.exchange([3, 1, 0, 7, 1, 0]) == [[3, 1, 0, 7, 1, 0]]
    with pytest.raises(ValueError, match="a slot holds 7 values"):
        ShmExchange(str(tmp_path / "wide"), 0, 1, 8, create=True)


def _layout_rank(rank, hosts, port, steps, then, results):
    """A rank of a group laid out over `hosts` (fake host names): set up the host exchange, then
    exchange `steps` times at an uneven pace, checking every rank's values each time."""
    import torch.distributed as dist

    import engine.shm_pool as shm_pool
    shm_pool.host_id = lambda: hosts[rank]
    world = len(hosts)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        ex = host_exchange(rank, world, 6, group, timeout_s=3.0, address="127.0.0.1")
        files = [p for p in (getattr(ex, "path", None), getattr(getattr(ex, "local", None), "path", None)) if p]
        rng, bad, error = random.Random(rank), [], None
        try:
            for step in range(1, steps + 1):
                if then == "exit" and rank == 1 and step == 3:
                    os._exit(0)  # results of this rank never come
                if then == "stall" and rank == 1 and step == 3:
                    time.sleep(60)  # alive, never at step 3 (killed first)
                if rng.random() < 0.1:
                    time.sleep(rng.random() * 2e-3)
                got = ex.exchange(_values(rank, step))
                if got != [_values(r, step) for r in range(world)]:
                    bad.append((step, got))
        except RuntimeError as e:
            error = str(e)
        over_gloo = GlooExchange(group, world).exchange([rank, 9, 0, 0, 0, 1 << 50]) if then is None else None
        results.put((rank, type(ex).__name__, bad[:3], error, any(os.path.exists(p) for p in files), over_gloo))
    finally:
        if then is None:
            dist.destroy_process_group()


def _run_layout(hosts, steps, then=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_layout_rank, args=(r, hosts, port, steps, then, results)) for r in range(len(hosts))]
    for p in procs:
        p.start()
    try:
        outs, deadline = {}, time.monotonic() + 120
        while len(outs) < len(hosts) - (then is not None) and time.monotonic() < deadline:
            for p in procs:
                p.is_alive()  # reaps a rank that has exited, as a real parent would: its pid is then gone
            try:
                r, *rest = results.get(timeout=0.2)
                outs[r] = rest
            except queue.Empty:
                pass
        return outs
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()


@pytest.mark.parametrize("hosts,form", [
    (["a", "a"], "ShmExchange"),
    (["a", "b"], "HostsExchange"),
    (["a", "b", "a", "b", "b"], "HostsExchange"),  # the ranks of a host need not be neighbours
])
def test_the_group_agrees_on_one_host_and_across_hosts(hosts, form):
    """Ranks of one host agree through shared memory; ranks of several hosts through shared
    memory on each and TCP between the hosts' leaders. Every rank gets every rank's values at
    every step, and no shared-memory file is left behind."""
    outs = _run_layout(hosts, steps=200)
    world = len(hosts)
    for rank in range(world):
        name, bad, error, file_left, over_gloo = outs[rank]
        assert (name, bad, error, file_left) == (form, [], None, False)
        assert over_gloo == [[r, 9, 0, 0, 0, 1 << 50] for r in range(world)]  # CPU groups' form


@pytest.mark.parametrize("then,leaders,local", [
    ("exit", "the leader of host 1 of the decode group is gone", "rank 1 of the decode group (pid"),
    ("stall", "the leader of host 1 of the decode group did not reach step 3 in 3 s",
     "ranks [1] of the decode group did not reach step 3 in 3 s")])
def test_a_host_leader_gone_or_stuck_fails_both_hosts_waits(then, leaders, local):
    """Rank 1 leads host b and exits (or stalls): rank 0, host a's leader, reads its connection
    closed (or times out on it); rank 2, on host b, sees its leader's process gone (or late).
    Both end with an error naming rank 1's part, not a hang."""
    outs = _run_layout(["a", "b", "b"], steps=10, then=then)
    assert set(outs) == {0, 2}
    assert leaders in outs[0][2] and local in outs[2][2]


def test_agreement_latency_bench_runs_every_form():
    """bench.agree_latency, a smoke run: ExpertParallel.agree over each form, a group of 4 ranks
    split over two fake hosts for `hosts`."""
    from bench.agree_latency import measure
    for form in ("hosts", "shm", "gloo"):
        row = measure(4, 20, form)
        assert row["form"] == form and 0 < row["p50_us"] <= row["max_us"]


def test_leaders_meet_over_tcp_turning_strangers_away():
    """LeaderMesh.connect in one process (two threads): a connection without the group's token
    is dropped, the peer's is kept, and a swap hands each side the other's payload."""
    import threading

    from engine.host_mesh import LeaderMesh
    token = b"g" * 16
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    addresses = [lst.getsockname()[:2] for lst in listeners]
    stranger = socket.create_connection(addresses[0])
    stranger.sendall(b"x" * 20)
    meshes = {}

    def join(index):
        meshes[index] = LeaderMesh.connect(index, addresses, listeners[index], token, 5.0)
    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert set(meshes) == {0, 1} and list(meshes[0].peers) == [1] and list(meshes[1].peers) == [0]
    got = {}
    threads = [threading.Thread(target=lambda i=i: got.update({i: meshes[i].swap(7, bytes([i]) * 3)}))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert got == {0: {1: b"\x01" * 3}, 1: {0: b"\x00" * 3}}
    for m in meshes.values():
        m.close()
    stranger.close()


def test_leaders_that_cannot_meet_fail_naming_the_address():
    from engine.host_mesh import LeaderMesh
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[:2]  # nothing listens here once it is closed
    listener = socket.create_server(("127.0.0.1", 0))
    with pytest.raises(RuntimeError, match=f"host 1's leader cannot reach host 0's at 127.0.0.1:{closed[1]}"):
        LeaderMesh.connect(1, [closed, listener.getsockname()[:2]], listener, b"g" * 16, 1.0)
    listener.close()
    listener = socket.create_server(("127.0.0.1", 0))
    with pytest.raises(RuntimeError, match=r"the leaders of hosts \[1\] did not connect to host 0's in 0 s"):
        LeaderMesh.connect(0, [listener.getsockname()[:2], closed], listener, b"g" * 16, 0.3)
    listener.close()
