"""KVTransport over real NIXL (UCX on host memory): in one process, across processes, and the
ways a transfer is refused or fails. NIXL is a declared dependency, so a failed import fails
this module instead of skipping it."""

import asyncio
import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

import nixl._api  # noqa: F401  (fail loudly here if NIXL is missing)
from engine.kv_transfer import KVTransport, TransferError

BS = 4  # tokens per block
LAYERS = 3
WIDTHS = (24, 8)  # a global-KV-like and an index-keys-like tensor


def _pool(num_blocks, seed, widths=WIDTHS, dtype=torch.float16, layers=LAYERS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(layers, num_blocks * BS, w, generator=g).to(dtype) for w in widths]


def _name(tag):
    # Agent names must be unique among peers; repeated runs must not collide either.
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _blocks(t, ids):
    """[layers, len(ids), BS, width] view of blocks ids, as raw bytes so NaN-free equality
    is byte equality."""
    v = t.view(t.shape[0], -1, BS, t.shape[2])[:, list(ids)]
    return v.contiguous().view(torch.uint8)


def _assert_copied(src_pool, dst_before, dst_after, src_ids, dst_ids, num_dst_blocks):
    untouched = [b for b in range(num_dst_blocks) if b not in set(dst_ids)]
    for i, (s, before, after) in enumerate(zip(src_pool, dst_before, dst_after)):
        assert torch.equal(_blocks(after, dst_ids), _blocks(s, src_ids)), f"tensor {i}: destination blocks differ"
        assert torch.equal(_blocks(after, untouched), _blocks(before, untouched)), f"tensor {i}: other blocks changed"


@pytest.fixture(scope="module")
def pair():
    """A (8 blocks) and B (6 blocks): pool sizes may differ, so range checks are per side."""
    a_pool, b_pool = _pool(8, seed=1), _pool(6, seed=2)
    a = KVTransport(_name("A"), a_pool, BS)
    b = KVTransport(_name("B"), b_pool, BS)
    try:
        peer = a.connect(b.metadata())
        yield a, b, peer, a_pool, b_pool
    finally:
        a.close()
        b.close()


def test_write_in_process(pair):
    a, b, peer, a_pool, b_pool = pair
    src, dst = [6, 1, 2, 3], [0, 4, 5, 2]
    before = [t.clone() for t in b_pool]
    h = a.write_blocks(peer, src, dst, b"req-1")
    a.wait(h, timeout_s=5)
    assert b.wait_notification(b"req-1", timeout_s=5)
    _assert_copied(a_pool, before, b_pool, src, dst, 6)
    # [1,2] -> [4,5] is one run; 6->0 and 3->2 are runs of one: 3 runs x (3 + 3) layers
    assert h.num_descs == 3 * 2 * LAYERS
    assert h.nbytes == sum(len(src) * BS * LAYERS * t.shape[2] * t.element_size() for t in a_pool)


def test_connect_is_idempotent(pair):
    a, b, peer, *_ = pair
    assert a.connect(b.metadata()) == peer


def test_notifications_out_of_order_are_kept(pair):
    a, b, peer, *_ = pair
    for n in (b"first", b"second"):
        a.wait(a.write_blocks(peer, [0], [1], n), timeout_s=5)
    assert b.wait_notification(b"second", timeout_s=5)
    assert b.wait_notification(b"first", timeout_s=5)
    assert not b.check_notification(b"first"), "a notification must be consumed once"


def test_empty_write_still_notifies(pair):
    a, b, peer, *_ = pair
    h = a.write_blocks(peer, [], [], b"nothing-to-move")
    a.wait(h, timeout_s=1)
    assert h.nbytes == 0
    assert b.wait_notification(b"nothing-to-move", timeout_s=5)


def test_discarded_notification_is_dropped_on_arrival(pair):
    a, b, peer, *_ = pair
    b.discard_notification(b"abandoned")
    a.wait(a.write_blocks(peer, [0], [0], b"abandoned"), timeout_s=5)
    a.wait(a.write_blocks(peer, [0], [0], b"marker"), timeout_s=5)
    assert b.wait_notification(b"marker", timeout_s=5)
    assert not b.check_notification(b"abandoned")


def test_async_wait(pair):
    a, b, peer, a_pool, b_pool = pair

    async def go():
        h = a.write_blocks(peer, [7], [3], b"async")
        await a.wait_async(h, timeout_s=5)
        return await b.wait_notification_async(b"async", timeout_s=5)

    assert asyncio.run(go())
    assert torch.equal(_blocks(b_pool[0], [3]), _blocks(a_pool[0], [7]))


@pytest.mark.parametrize("src,dst,match", [
    ([8], [0], r"source block id\(s\) \[8\] out of range: .* has blocks 0\.\.7"),
    ([-1], [0], r"source block id\(s\) \[-1\] out of range"),
    ([0], [6], r"destination block id\(s\) \[6\] out of range: .* has blocks 0\.\.5"),
    ([0, 1], [2], r"length mismatch: 2 source blocks, 1 destination blocks"),
    ([0, 1], [2, 2], r"destination blocks repeat"),
    ([0.5], [1], r"source blocks must be a flat list of ints"),
])
def test_invalid_blocks_refused(pair, src, dst, match):
    a, b, peer, *_ = pair
    with pytest.raises(TransferError, match=match):
        a.write_blocks(peer, src, dst, b"never")
    assert not b.wait_notification(b"never", timeout_s=0.05)


def test_unknown_peer(pair):
    a, *_ = pair
    with pytest.raises(TransferError, match=r"unknown peer 'nobody'"):
        a.write_blocks("nobody", [0], [0], b"x")


def test_wait_notification_times_out(pair):
    _, b, *_ = pair
    t0 = time.monotonic()
    assert b.wait_notification(b"never-sent", timeout_s=0.1) is False
    assert time.monotonic() - t0 >= 0.1


@pytest.mark.parametrize("kwargs,match", [
    (dict(widths=(24, 16)), r"tensor 1 width 16 != local 8"),
    (dict(widths=(24,)), r"1 KV tensors != local 2"),
    (dict(layers=2), r"tensor 0 layers 2 != local 3"),
    (dict(dtype=torch.bfloat16), r"tensor 0 dtype bfloat16 != local float16"),
    (dict(dtype=torch.float32), r"tensor 0 element_size 4 != local 2"),
])
def test_incompatible_layout_refused(pair, kwargs, match):
    a, *_ = pair
    with KVTransport(_name("C"), _pool(2, seed=3, **kwargs), BS) as c:
        with pytest.raises(TransferError, match=match):
            a.connect(c.metadata())


def test_block_size_mismatch_refused(pair):
    a, *_ = pair
    with KVTransport(_name("C"), _pool(2, seed=3), BS * 2) as c:
        with pytest.raises(TransferError, match=rf"block_size {BS * 2} != local {BS}"):
            a.connect(c.metadata())


def test_closed_transport_refuses():
    t = KVTransport(_name("Z"), _pool(1, seed=4), BS)
    t.close()
    t.close()  # idempotent
    with pytest.raises(TransferError, match="is closed"):
        t.metadata()


# -- across processes --------------------------------------------------------------------------

def _snapshot(pool):
    # Numpy copies travel by value; torch tensors would travel as shared-memory handles that the
    # parent can no longer open once this process has exited.
    return [p.numpy().copy() for p in pool]


def _receiver(conn, name, die_on_request):
    pool = _pool(5, seed=7)
    t = KVTransport(name, pool, BS)
    conn.send((t.metadata(), _snapshot(pool)))
    if die_on_request:
        conn.recv()
        os._exit(0)  # no close(): the point is a peer that vanishes without a word
    try:
        got = t.wait_notification(b"xproc", timeout_s=20)
        conn.send((got, _snapshot(pool)))
    finally:
        t.close()


@pytest.fixture(scope="module")
def receivers():
    """Both receiver processes start together: most of their start-up is importing torch and
    creating an agent, which overlaps."""
    ctx = mp.get_context("spawn")
    procs = {}
    for role in ("live", "dying"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_receiver, args=(child, _name("R"), role == "dying"), daemon=True)
        proc.start()
        procs[role] = (proc, parent)
    try:
        yield procs
    finally:
        for proc, _ in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _handshake(proc, conn):
    if not conn.poll(60):
        raise AssertionError(f"receiver process did not start (exit code {proc.exitcode})")
    meta, before = conn.recv()
    return meta, [torch.from_numpy(b) for b in before]


def test_write_across_processes(receivers):
    a_pool = _pool(8, seed=5)
    proc, conn = receivers["live"]
    meta, before = _handshake(proc, conn)
    with KVTransport(_name("S"), a_pool, BS) as a:
        peer = a.connect(meta)
        src, dst = [7, 0, 1, 4], [1, 2, 3, 0]
        a.wait(a.write_blocks(peer, src, dst, b"xproc"), timeout_s=10)
        assert conn.poll(20), "receiver did not report back"
        got, after = conn.recv()
    assert got, "notification did not arrive in the receiver process"
    _assert_copied(a_pool, before, [torch.from_numpy(x) for x in after], src, dst, 5)
    proc.join(10)
    assert proc.exitcode == 0


def test_write_to_dead_peer_fails_within_timeout(receivers):
    proc, conn = receivers["dying"]
    meta, _ = _handshake(proc, conn)
    with KVTransport(_name("S"), _pool(8, seed=6), BS) as a:
        peer = a.connect(meta)
        # A hung peer (stopped, so its worker makes no progress): the write may still complete
        # if UCX needs nothing from the target, but it must never outlive wait()'s deadline.
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            try:
                a.wait(a.write_blocks(peer, [2], [3], b"stalled"), timeout_s=0.3)
            except TransferError as e:
                assert "timed out after 0.3 s" in str(e)
            assert time.monotonic() - t0 < 1.5
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        conn.send("die")
        proc.join(10)
        assert proc.exitcode == 0
        t0 = time.monotonic()
        # UCX notices the closed endpoint and NIXL refuses the post; were it to go unnoticed,
        # wait()'s deadline would end it instead — a TransferError either way, never a hang.
        with pytest.raises(TransferError, match=r"peer disconnected|timed out"):
            a.wait(a.write_blocks(peer, [0, 1], [0, 1], b"lost"), timeout_s=3)
        assert time.monotonic() - t0 < 5
    with KVTransport(_name("L"), _pool(8, seed=6), BS) as late:
        with pytest.raises(TransferError, match=r"cannot add peer 'R-"):
            late.connect(meta)
