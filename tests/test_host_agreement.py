"""The step's agreement on the host (engine/host_agreement.py): shared memory between the ranks of
one host, gloo otherwise; run in spawned processes, as a decode group's ranks are."""
import multiprocessing as mp
import os
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


def _setup_rank(rank, world, port, other_host, results):
    import torch.distributed as dist

    import engine.shm_pool as shm_pool
    if other_host:
        shm_pool.host_id = lambda: f"host-{rank}"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        ex = host_exchange(rank, world, 6, group)
        got = [ex.exchange([rank, step, 0, 0, 0, 0]) for step in range(3)] if ex is not None else None
        path = getattr(ex, "path", None)
        over_gloo = GlooExchange(group, world).exchange([rank, 9, 0, 0, 0, 1 << 50])  # CPU groups' form
        results.put((rank, type(ex).__name__, got, path is not None and os.path.exists(path), over_gloo))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("other_host,form", [(False, "ShmExchange"), (True, "NoneType")])
def test_the_group_picks_shared_memory_on_one_host(other_host, form):
    """Ranks of one host agree through shared memory, whose file is unlinked once all have it
    open; ranks of several hosts get no host exchange (their GPUs agree over NCCL)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_setup_rank, args=(r, 2, port, other_host, results)) for r in range(2)]
    for p in procs:
        p.start()
    outs = dict((r, rest) for r, *rest in (results.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=10)
    for rank in range(2):
        name, got, file_left, over_gloo = outs[rank]
        assert name == form and not file_left
        assert over_gloo == [[0, 9, 0, 0, 0, 1 << 50], [1, 9, 0, 0, 0, 1 << 50]]
        if form == "ShmExchange":
            assert got == [[[0, step, 0, 0, 0, 0], [1, step, 0, 0, 0, 0]] for step in range(3)]
