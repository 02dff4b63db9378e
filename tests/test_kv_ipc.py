"""IpcTransport (same-host KV transport): a decode-side pool in /dev/shm written by another
process, the refusals, timeouts, clean-up of the pool files, an engine hand-off through it,
and (where CUDA is present) the same across processes on GPUs."""
import asyncio
import multiprocessing as mp
import os
import threading

import pytest
import torch

from engine.kv_ipc import (IpcTransferError, IpcTransport, ShmPool, _word_view, host_id, pool_tensors,
                           shared_kv_pool)

BS = 4
LAYERS = 3


def _pool(num_blocks, seed, device="cpu"):
    """A global-KV-like, an index-keys-like and an FP8-scale-like ([layers, slots]) tensor."""
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * BS
    return [t.to(device) for t in (torch.randn(LAYERS, slots, 24, generator=g).to(torch.bfloat16),
                                   torch.randn(LAYERS, slots, 8, generator=g).to(torch.float16),
                                   torch.rand(LAYERS, slots, generator=g))]


def _shm(tensors, directory=None):
    pool = ShmPool(directory) if directory else ShmPool()
    return pool, [pool(f"t{i}", t) for i, t in enumerate(tensors)]


def _blocks(t, ids):
    """Blocks `ids` of t as raw bytes, so equality is bit equality."""
    v = t.reshape(t.shape[0], -1, BS, *t.shape[2:])[:, list(ids)]
    return v.contiguous().view(torch.uint8).cpu()


def _assert_copied(src, before, after, src_ids, dst_ids):
    untouched = [b for b in range(before[0].shape[1] // BS) if b not in set(dst_ids)]
    for i, (s, b, a) in enumerate(zip(src, before, after)):
        assert torch.equal(_blocks(a, dst_ids), _blocks(s, src_ids)), f"tensor {i}: destination blocks differ"
        assert torch.equal(_blocks(a, untouched), _blocks(b, untouched)), f"tensor {i}: other blocks changed"


# -- across processes (CPU: /dev/shm) ----------------------------------------------------------------

def _wire(tensors):
    # Raw bytes as numpy travel by value; torch tensors would travel as shared-memory handles.
    return [(x.cpu().contiguous().view(torch.uint8).numpy().copy(), str(x.dtype)[6:], list(x.shape)) for x in tensors]


def _unwire(items):
    return [torch.from_numpy(a).view(getattr(torch, dtype)).view(shape) for a, dtype, shape in items]


def _decode_side(conn, num_blocks, seed, crash):
    """The exporting side: a pool in /dev/shm, its handle and contents sent to the parent."""
    pool, tensors = _shm(_pool(num_blocks, seed))
    t = IpcTransport("decode", tensors, BS)
    conn.send((t.metadata(), _wire(tensors), pool.paths))
    if crash:
        conn.recv()
        os._exit(0)  # no close(): its files stay behind until the next pool sweeps them
    conn.recv()  # "written"
    conn.send(_wire(tensors))
    t.close()
    conn.send([os.path.exists(p) for p in pool.paths])
    conn.recv()


@pytest.fixture(scope="module")
def decode_procs():
    """Two exporting processes started together (most of their start-up is importing torch)."""
    ctx = mp.get_context("spawn")
    procs = {}
    for role, crash in (("live", False), ("crash", True)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_decode_side, args=(child, 6, 11, crash), daemon=True)
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
    assert conn.poll(90), f"decode process did not start (exit code {proc.exitcode})"
    return conn.recv()


def test_write_across_processes_lands_in_the_peer_pool(decode_procs):
    proc, conn = decode_procs["live"]
    meta, before, paths = _handshake(proc, conn)
    assert meta["transport"] == "ipc" and meta["pid"] == proc.pid and meta["host"] == host_id()
    assert all(os.path.exists(p) for p in paths)
    src = _pool(8, seed=5)
    with IpcTransport("prefill", src, BS) as p:
        peer = p.connect(meta)
        assert p.connect(meta) == peer  # opened once
        src_ids, dst_ids = [7, 0, 1, 4, 5], [5, 2, 3, 0, 1]  # runs and jumps on both sides
        h = p.write_blocks(peer, src_ids, dst_ids)
        p.wait(h, timeout_s=20)
        assert h.done and h.nbytes == 5 * BS * LAYERS * (24 * 2 + 8 * 2 + 4)
        assert p.writes == 1 and p.bytes_written == h.nbytes
        conn.send("written")
        assert conn.poll(30)
        after = _unwire(conn.recv())
    _assert_copied(src, _unwire(before), after, src_ids, dst_ids)
    assert conn.poll(30)
    assert conn.recv() == [False] * len(paths), "close() must unlink the exported pool files"
    conn.send("bye")
    proc.join(10)
    assert proc.exitcode == 0


def test_files_of_a_crashed_exporter_are_swept_by_the_next_pool(decode_procs):
    proc, conn = decode_procs["crash"]
    _, _, paths = _handshake(proc, conn)
    conn.send("die")
    proc.join(10)
    assert all(os.path.exists(p) for p in paths), "a killed process cannot unlink its files"
    pool = ShmPool()
    pool("probe", torch.zeros(1, 4))
    try:
        assert not any(os.path.exists(p) for p in paths)
    finally:
        pool.close()
    assert not os.path.exists(pool.paths[0])


# -- one process ----------------------------------------------------------------------------------

@pytest.fixture
def pair():
    """An exporting pool of 6 blocks (mapped again from its files, as another process would)
    and a writing transport over 8 plain blocks."""
    pool, dst = _shm(_pool(6, seed=2))
    d = IpcTransport("decode", dst, BS)
    meta = dict(d.metadata(), pid=-1)  # not this process: open the files rather than the registry
    p = IpcTransport("prefill", _pool(8, seed=1), BS)
    yield p, d, meta, dst
    p.close()
    d.close()
    pool.close()


@pytest.mark.parametrize("mode", ["runs", "indexed"])
def test_write_async_and_empty_write(pair, mode):
    p, d, meta, dst = pair
    p.copy_mode = mode  # CPU copies run by run unless told otherwise; CUDA copies scattered blocks indexed
    peer = p.connect(meta)
    before = [t.clone() for t in dst]
    src_ids, dst_ids = [3, 2, 6, 7, 0], [5, 4, 0, 1, 3]
    h = p.write_blocks(peer, src_ids, dst_ids)
    asyncio.run(p.wait_async(h, timeout_s=10))
    assert p.poll(h)
    _assert_copied(p._tensors, before, dst, src_ids, dst_ids)
    empty = p.write_blocks(peer, [], [])
    assert empty.done and empty.nbytes == 0 and p.poll(empty)


def test_refusals(pair):
    p, d, meta, dst = pair
    with pytest.raises(IpcTransferError, match="unknown peer"):
        p.write_blocks("nobody", [0], [0])
    peer = p.connect(meta)
    with pytest.raises(IpcTransferError, match="length mismatch"):
        p.write_blocks(peer, [0, 1], [0])
    with pytest.raises(IpcTransferError, match=r"destination block id\(s\) \[6\] out of range"):
        p.write_blocks(peer, [0], [6])
    with pytest.raises(IpcTransferError, match=r"source block id\(s\) \[8\] out of range"):
        p.write_blocks(peer, [8], [0])
    with pytest.raises(IpcTransferError, match="repeat"):
        p.write_blocks(peer, [0, 1], [2, 2])
    with pytest.raises(IpcTransferError, match="flat list of ints"):
        p.write_blocks(peer, [0.5], [1])
    other = dict(meta, name="elsewhere", host="some-other-machine/boot")
    with pytest.raises(IpcTransferError, match="not this one"):
        p.connect(other)
    with pytest.raises(IpcTransferError, match="block_size"):
        p.connect(dict(meta, name="b", block_size=8))
    narrow = dict(meta, name="w", tensors=[dict(meta["tensors"][0], width=16)] + meta["tensors"][1:])
    with pytest.raises(IpcTransferError, match="tensor 0 width 16 != local 24"):
        p.connect(narrow)
    with pytest.raises(IpcTransferError, match="sent no IPC handle"):
        p.connect({"name": "nixl-peer", "agent_metadata": b""})
    with pytest.raises(IpcTransferError, match="not a shared-memory pool file"):
        IpcTransport("plain", _pool(2, seed=3), BS).metadata()
    assert all(torch.equal(a, b) for a, b in zip(dst, _pool(6, seed=2))), "a refused write wrote"


def test_a_replaced_file_is_not_mapped(pair, tmp_path):
    p, d, meta, _ = pair
    t0 = meta["tensors"][0]
    fake = tmp_path / "impostor"
    fake.write_bytes(b"\0" * t0["nbytes"])
    bad = dict(meta, name="x", export_id="new", tensors=[dict(t0, path=str(fake))] + meta["tensors"][1:])
    with pytest.raises(IpcTransferError, match="not the file the peer exported"):
        p.connect(bad)
    gone = dict(meta, name="y", export_id="new2", tensors=[dict(t0, path=str(tmp_path / "missing"))])
    with pytest.raises(IpcTransferError, match="cannot open peer 'y' tensor 0"):
        p.connect(dict(gone, tensors=gone["tensors"] + meta["tensors"][1:]))
    assert not (tmp_path / "missing").exists()


def test_timeout_leaves_the_copy_to_finish_and_close_waits_for_it(pair):
    p, d, meta, dst = pair
    peer = p.connect(meta)
    p.write_blocks(peer, [0], [0])  # starts the worker thread
    gate = threading.Event()
    p._executor.submit(gate.wait)  # the next copy queues behind this
    before = [t.clone() for t in dst]
    h = p.write_blocks(peer, [6], [3])
    with pytest.raises(IpcTransferError, match="timed out after 0.05 s"):
        p.wait(h, timeout_s=0.05)
    with pytest.raises(IpcTransferError, match="timed out"):
        p.poll(h)  # stays failed even once the copy ends
    assert h in p._inflight, "an abandoned copy keeps its destination mapped until it ends"
    gate.set()
    p.close()  # waits for the copy
    _assert_copied(p._tensors, before, dst, [0, 6], [0, 3])
    with pytest.raises(IpcTransferError, match="is closed"):
        p.write_blocks(peer, [1], [1])


def test_close_unlinks_exported_files_and_a_restarted_peer_is_reopened(tmp_path):
    pool, dst = _shm(_pool(2, seed=4), directory=str(tmp_path))
    d = IpcTransport("decode", dst, BS)
    meta = dict(d.metadata(), pid=-1)
    assert d.metadata() is d.metadata()  # exported once
    p = IpcTransport("prefill", _pool(2, seed=5), BS)
    peer = p.connect(meta)
    d.close()
    assert sorted(os.listdir(tmp_path)) == []
    h = p.write_blocks(peer, [1], [0])  # the mapping outlives the name
    p.wait(h, 5)
    assert torch.equal(_blocks(dst[0], [0]), _blocks(p._tensors[0], [1]))
    with pytest.raises(IpcTransferError, match="cannot open"):
        p.connect(dict(meta, export_id="restarted"))
    pool2, dst2 = _shm(_pool(2, seed=6), directory=str(tmp_path))
    d2 = IpcTransport("decode", dst2, BS)
    assert p.connect(dict(d2.metadata(), pid=-1)) == peer
    p.wait(p.write_blocks(peer, [0], [1]), 5)
    assert torch.equal(_blocks(dst2[0], [1]), _blocks(p._tensors[0], [0]))
    for x in (p, d2, pool, pool2):
        x.close()


def test_word_view_is_widest_exact_type():
    assert _word_view(torch.zeros(2, 8, 6, dtype=torch.bfloat16), 4).dtype == torch.int64   # 48 bytes a block row
    assert _word_view(torch.zeros(2, 3, 3, dtype=torch.float16), 1).dtype == torch.int16    # 6 bytes
    assert _word_view(torch.zeros(2, 3, dtype=torch.uint8), 1).dtype == torch.uint8
    v = _word_view(torch.arange(2 * 8 * 2, dtype=torch.float32).view(2, 8, 2), 4)
    assert v.shape == (2, 2, 4)


# -- an engine hand-off through the transport ---------------------------------------------------------

def test_engine_pool_in_shm_and_pd_handoff_equals_decode_alone(tiny_ckpt):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    cfg = EngineConfig(block_size=4, num_blocks=64)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with shared_kv_pool() as pool:
        decode = LLMEngine.from_pretrained(tiny_ckpt, cfg, progress=False)
    prefill = LLMEngine.from_pretrained(tiny_ckpt, cfg, progress=False)
    assert len(pool.paths) == len(pool_tensors(decode.runner.kv)) >= 1
    ptr = [e.runner.kv.global_kv.untyped_storage().data_ptr() for e in (prefill, decode)]
    assert ptr[0] != ptr[1]
    d = IpcTransport("decode", pool_tensors(decode.runner.kv), cfg.block_size)
    p = IpcTransport("prefill", pool_tensors(prefill.runner.kv), cfg.block_size)
    try:
        peer = p.connect(dict(d.metadata(), pid=-1))
        prompt = torch.randint(4, 500, (30,), generator=torch.Generator().manual_seed(3)).tolist()
        res = decode.reserve_remote("r", prompt, greedy)
        prefill.add_request("r", res["prompt_token_ids"], SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
        done = []
        while prefill.has_unfinished_requests():
            done += [o for o in prefill.step() if o.finished]
        first = done[0].output_token_ids[0]
        src = prefill.held_blocks("r")[res["cached_blocks"]:]
        p.wait(p.write_blocks(peer, src, res["dst_blocks"]), 10)
        # Attention is blind to a permutation of whole prompt blocks, so check the bytes too.
        for a, b in zip(pool_tensors(prefill.runner.kv), pool_tensors(decode.runner.kv)):
            assert torch.equal(_blocks(b, res["dst_blocks"]), _blocks(a, src))
        prefill.release_held("r")
        decode.commit_remote("r", first)
        out = None
        while decode.has_unfinished_requests():
            out = next((o for o in decode.step() if o.finished), out)
        alone = LLMEngine.from_pretrained(tiny_ckpt, cfg, progress=False).generate([prompt], greedy)[0]
        assert out.output_token_ids == alone.output_token_ids
        assert decode.stats()["kv_blocks_used"] == 0 and prefill.stats()["kv_blocks_used"] == 0
    finally:
        p.close()
        d.close()
        pool.close()


# -- CUDA (on a GPU machine) -------------------------------------------------------------------------

def _cuda_decode_side(conn, device, num_blocks, seed):
    torch.cuda.set_device(device)
    tensors = _pool(num_blocks, seed, device=f"cuda:{device}")
    t = IpcTransport("decode", tensors, BS)
    conn.send((t.metadata(), _wire(tensors)))
    conn.recv()
    conn.send(_wire(tensors))
    conn.recv()
    t.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_write_across_processes():
    """The exporter on the last GPU (the same one when there is one), the writer on GPU 0."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dev = torch.cuda.device_count() - 1
    proc = ctx.Process(target=_cuda_decode_side, args=(child, dev, 6, 21), daemon=True)
    proc.start()
    try:
        meta, before = _handshake(proc, parent)
        before = _unwire(before)
        assert meta["tensors"][0]["kind"] == "cuda"
        src = _pool(8, seed=22, device="cuda:0")
        with IpcTransport("prefill", src, BS) as p:
            peer = p.connect(meta)
            src_ids, dst_ids = [7, 0, 1, 4, 5], [5, 2, 3, 0, 1]
            p.wait(p.write_blocks(peer, src_ids, dst_ids), 20)
            parent.send("written")
            assert parent.poll(30)
            after = _unwire(parent.recv())
        _assert_copied([s.cpu() for s in src], before, after, src_ids, dst_ids)
        parent.send("bye")
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
