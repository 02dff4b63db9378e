"""Paged MLA decode kernel (Triton) against its plain-torch reference, and FP8 KV round trips."""
import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

from wideep_kernels.fp8_kv import FP8_MAX, dequantize_kv, quantize_kv  # noqa: E402
from wideep_kernels import mla_decode as mla_module  # noqa: E402
from wideep_kernels import mla_decode_gluon  # noqa: E402
from wideep_kernels.mla_decode import mla_decode, mla_decode_reference, mla_decode_triton  # noqa: E402

triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpreter_really_on(request):
    # triton.jit picks interpreter or compiler when a kernel is defined: if anything imported
    # triton before TRITON_INTERPRET was set (tests/conftest.py imports the engine), CPU runs fail
    # deep inside Triton. Say why instead.
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("device") == "cpu":
        if type(mla_module._split_kernel).__name__ != "InterpretedFunction":
            pytest.fail("Triton was imported before TRITON_INTERPRET=1 was set: run with TRITON_INTERPRET=1 "
                        "in the environment, or set it in tests/conftest.py before importing engine")

KV_LORA, ROPE, BS = 32, 8, 4
D = KV_LORA + ROPE
SCALE = D ** -0.5

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="CPU runs Triton only under TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}


def make_case(g_lens, heads, dtype, device, seed=0, extra_blocks=1, kv_lora=KV_LORA, rope=ROPE):
    """Random latents in a shuffled paged slab; table entries past a sequence's blocks are -1."""
    gen = torch.Generator().manual_seed(seed)
    b, d = len(g_lens), kv_lora + rope
    max_blocks = max(-(-g // BS) for g in g_lens) + extra_blocks
    num_blocks = b * max_blocks + 3
    kv = torch.randn(num_blocks * BS, d, generator=gen)
    q = torch.randn(b, heads, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, g in enumerate(g_lens):
        n = -(-g // BS)
        table[i, :n] = perm[used:used + n].int()
        used += n
    lens = torch.tensor(g_lens, dtype=torch.int32)
    return (q.to(dtype).to(device), kv.to(dtype).to(device), table.to(device), lens.to(device))


def check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g_lens,heads,num_splits", [
    ([1], 2, None),              # batch 1, a single key
    ([5, 18, 37], 4, None),      # lengths off the block and tile sizes
    ([5, 18, 37], 3, 3),         # several splits per sequence, some of them empty
    ([0, 13], 2, 2),             # a sequence with no key at all
    ([700, 40], 2, 40),          # more splits than the merge sums at once (16 with few programs)
    ([30, 9], 72, 6),            # many (sequence, head) programs: the merge sums 4 splits at once
])
def test_dense_matches_reference(device, dtype, g_lens, heads, num_splits):
    q, kv, table, lens = make_case(g_lens, heads, dtype, device)
    out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, num_splits=num_splits)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA)
    check(out, ref, dtype)
    empty = [i for i, g in enumerate(g_lens) if g == 0]
    if empty:
        assert (out[empty] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_sc", [16, 4])
def test_merge_rescales_when_a_later_block_of_splits_holds_the_maximum(device, block_sc):
    """The merge sums the splits in one pass, BLOCK_SC at a time: the first block all empty (no
    key), the largest maximum in the last one, empty splits between, a sequence with none live."""
    b, splits, heads, cols = 2, 37, 3, KV_LORA
    gen = torch.Generator().manual_seed(3)
    m = torch.rand(b, splits, heads, generator=gen) * 4
    m[:, :16] = -1.0e30
    m[:, 20:30] = -1.0e30
    m[0, 36] = 40.0  # 2^36 above the rest: the running sums must be scaled down, not overflow
    m[1] = -1.0e30
    live = m > -1.0e30
    l = torch.where(live, torch.rand(b, splits, heads, generator=gen) + 0.5, torch.zeros(()))
    acc = torch.where(live[..., None], torch.randn(b, splits, heads, cols, generator=gen), torch.zeros(()))
    acc[~live] = float("nan")  # an empty split's partial sum is never read
    out = torch.empty(b, heads, cols)
    mla_module._merge_kernel[(1, heads, b)](
        acc.to(device), m.to(device), l.to(device), out := out.to(device), out.stride(0), out.stride(1),
        splits, heads, cols, BLOCK_SC=block_sc, BLOCK_CC=cols, num_warps=4)
    w = torch.exp2(m - m.amax(1, keepdim=True)) * live
    want = (w[..., None] * acc.nan_to_num()).sum(1) / (w * l).sum(1).clamp_min(1e-30)[..., None]
    want[1] = 0.0  # no key at all: zeros
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("keys_rows", [False, True])
def test_dense_rows_in_a_far_wider_table(device, num_splits, keys_rows):
    """A block table far wider than every row (a CUDA graph's shared width): the splits deal the
    rows' own tiles among them (some get none), with and without a window split."""
    q, kv, table, lens = make_case([70, 9, 33], 4, torch.bfloat16, device, seed=6, extra_blocks=30)
    config = dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1, keys_rows=keys_rows)
    win = torch.randn(3, 21, D, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(device)
    for kwargs in (dict(), dict(win_kv=win)):
        out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, num_splits=num_splits, config=config,
                                **kwargs)
        check(out, mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, **kwargs), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_keys(device, dtype):
    g_lens = [0, 0, 11]
    q, kv, table, lens = make_case(g_lens, 3, dtype, device, seed=1)
    gen = torch.Generator().manual_seed(7)
    win = torch.randn(3, 21, D, generator=gen).to(dtype).to(device)
    valid = torch.rand(3, 21, generator=gen) < 0.6
    valid[0] = False          # no global and no window key -> zeros
    valid[1, :5] = True       # window keys only
    valid = valid.to(device)
    out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win, win_valid=valid,
                            num_splits=2)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win, win_valid=valid)
    check(out, ref, dtype)
    assert (out[0] == 0).all()
    assert out[1].abs().sum() > 0
    # The window must change the answer where it has keys (guards against it being ignored).
    no_win = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA)
    assert not torch.allclose(out[2].float(), no_win[2].float(), atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_positions(device, dtype):
    g_lens = [9, 30, 3]
    q, kv, table, lens = make_case(g_lens, 4, dtype, device, seed=2)
    topk = torch.tensor([[8, -1, 0, 3, -1, 5, -1, 1, 2, 12, 4, 6, 7, -1, -1, -1, -1, 4],
                         [29, 17, -1, 0, 12, 13, 14, 15, 16, 1, 2, 28, -1, 3, 4, 5, 6, 7],
                         [-1] * 18], dtype=torch.int32).to(device)
    win = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    valid = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]], dtype=torch.bool).to(device)
    # slots: the entries resolved to KV slots by a kernel of their own first; row 0 lists
    # positions past its length (9), which must count as no entry either way
    resolve = dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1, slots=True, q_reload=True)
    rows = dict(resolve, keys_rows=True)
    positions = dict(rows, slots=False)
    for kwargs, config in itertools.product((dict(), dict(win_kv=win, win_valid=valid)),
                                            (None, resolve, rows, positions)):
        out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, topk_pos=topk, num_splits=2,
                                config=config, **kwargs)
        ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, topk_pos=topk, **kwargs)
        check(out, ref, dtype)
    assert (mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, topk_pos=topk)[2] == 0).all()
    # Only the listed positions count: compare with dense attention over exactly those keys.
    dense = mla_decode_reference(q[1:2], kv, None, table[1:2], lens[1:2], BS, SCALE, KV_LORA)
    assert not torch.allclose(dense.float(), ref[1:2].float(), atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [16, 40])
@pytest.mark.parametrize("keys_rows", [0, 1, 2])
def test_real_widths_and_head_groups(device, fp8, heads, keys_rows):
    """D = 512 + 64 (the GPU tile configs), several tiles and splits; 40 heads need two programs;
    keys_rows 1 and 2: the keys-as-rows kernel at the 64-key tile it runs with on the GPU, 4 and 8 warps."""
    q, kv, table, lens = make_case([70, 2], heads, torch.bfloat16, device, seed=4, kv_lora=512, rope=64)
    scale = 576 ** -0.5
    kv_scale = None
    if fp8:
        kv, kv_scale = quantize_kv(kv)
    config = dict(block_n=64, num_warps=4 * keys_rows, num_stages=2, waves=1, min_tiles=1, keys_rows=True) if keys_rows else None
    out = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, num_splits=2, config=config)
    ref = mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512)
    check(out, ref, torch.bfloat16)


def test_fp8_round_trip_bound():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, D, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[3] = 0.0
    q, scale = quantize_kv(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    torch.testing.assert_close(scale[4:], x[4:].abs().amax(-1) / FP8_MAX)
    back = dequantize_kv(q, scale, torch.float32)
    assert (back[3] == 0).all()
    # E4M3 keeps 3 mantissa bits: round-to-nearest errs by at most 2^-4 relative for normal values;
    # values below the smallest normal (2^-6 in scaled units) err by at most half a 2^-9 step.
    err = (back - x).abs()
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale[:, None] * 1.001
    assert (err <= bound).all()
    assert (err / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)).max() <= 2.0 ** -4
    assert dequantize_kv(q, scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magnitude", ["spread", "tiny"])
def test_fp8_kv_matches_dequantized_reference(device, dtype, magnitude):
    g_lens = [6, 23, 0]
    q, kv, table, lens = make_case(g_lens, 3, torch.float32, device, seed=6)
    if magnitude == "spread":  # per-token scales differ a lot
        kv = kv * torch.logspace(-2, 2, kv.shape[0], device=device)[:, None]
    else:  # scales near 1e-6: scaled probabilities would underflow in fp16
        kv = kv * 1e-3
        q = q * 1e3
    kv8, scale = quantize_kv(kv)
    deq = dequantize_kv(kv8, scale, torch.float32)
    q = q.to(dtype)
    ref = mla_decode_reference(q, deq, None, table, lens, BS, SCALE, KV_LORA)
    torch.testing.assert_close(mla_decode_reference(q, kv8, scale, table, lens, BS, SCALE, KV_LORA), ref)
    topk = torch.tensor([[5, -1, 0, 2], [22, 7, -1, 11], [-1, -1, -1, -1]], dtype=torch.int32, device=device)
    win = torch.randn(3, 3, D, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    cases = [dict(), dict(topk_pos=topk), dict(win_kv=win)]
    for kwargs in cases:
        out = mla_decode_triton(q, kv8, scale, table, lens, BS, SCALE, KV_LORA, num_splits=2, **kwargs)
        ref = mla_decode_reference(q, deq, None, table, lens, BS, SCALE, KV_LORA, **kwargs)
        # Outputs scale with the keys (up to 100): compare relative to each row's size.
        size = ref.float().abs().amax(-1, keepdim=True).clamp(min=1e-6)
        check(out / size, ref / size, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_and_empty_batch(device, monkeypatch):
    q, kv, table, lens = make_case([7, 3], 2, torch.float32, device, seed=9)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA)
    calls = []
    real = mla_module.mla_decode_triton
    monkeypatch.setattr(mla_module, "mla_decode_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")  # CPU tensors take the (interpreted) kernel only when asked
    check(mla_decode(q, kv, None, table, lens, BS, SCALE, KV_LORA), ref, torch.float32)
    assert calls == [1]
    if device == "cpu":
        monkeypatch.delenv("WIDEEP_CPU_KERNELS")
        check(mla_decode(q, kv, None, table, lens, BS, SCALE, KV_LORA), ref, torch.float32)
        assert calls == [1]
    out = real(q[:0], kv, None, table[:0], lens[:0], BS, SCALE, KV_LORA)
    assert out.shape == (0, 2, KV_LORA)
    with pytest.raises(ValueError):
        real(q, kv.to(torch.float8_e4m3fn), None, table, lens, BS, SCALE, KV_LORA)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [
    dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1),
    dict(block_n=32, num_warps=8, num_stages=3, waves=4, min_tiles=2),
    dict(block_n=16, num_warps=4, num_stages=2, waves=2, min_tiles=1, q_reload=True),
    dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1, keys_rows=True),
    dict(block_n=32, num_warps=4, num_stages=3, waves=4, min_tiles=2, keys_rows=True),
    dict(block_n=64, num_warps=8, num_stages=2, waves=2, min_tiles=4, keys_rows=True),
])
def test_launch_configs_agree(device, config):
    """A tuned launch configuration (wideep_kernels/tuning.py) changes tiles and splits, not the result."""
    q, kv, table, lens = make_case([70, 2, 33], 16, torch.bfloat16, device, seed=5)
    win = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).to(device)
    out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win, config=config)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win)
    check(out, ref, torch.bfloat16)


def test_tuned_table_lookup(tmp_path, monkeypatch):
    import json

    from wideep_kernels import tuning
    (tmp_path / "Some_GPU.json").write_text(json.dumps({"mla_decode": {"k|b16": {"block_n": 32}}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_stem", lambda index: "Some_GPU")
    tuning.reload()
    try:
        assert tuning.tuned_config(torch.device("cuda", 0), "mla_decode", "k|b16") == {"block_n": 32}
        assert tuning.tuned_config(torch.device("cuda", 0), "mla_decode", "k|b64") is None
        assert tuning.tuned_config(torch.device("cpu"), "mla_decode", "k|b16") is None  # CPU keeps built-ins
    finally:
        tuning.reload()
    assert [tuning.batch_bucket(b) for b in (1, 2, 16, 17, 300)] == [1, 4, 16, 64, 256]


def test_tuned_table_of_the_same_capability(tmp_path, monkeypatch):
    """A GPU without a table of its own takes one tuned on a GPU of its compute capability;
    WIDEEP_TUNED_TABLE picks a table by name, or none."""
    import json

    from wideep_kernels import tuning
    (tmp_path / "Ampere_GPU.json").write_text(json.dumps({"capability": "8.0", "mla_decode": {"k": {"block_n": 16}}}))
    (tmp_path / "Hopper_GPU.json").write_text(json.dumps({"capability": "9.0", "mla_decode": {"k": {"block_n": 64}}}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_stem", lambda index: "Untuned_Hopper")
    monkeypatch.setattr(tuning, "_capability", lambda index: "9.0")
    monkeypatch.delenv("WIDEEP_TUNED_TABLE", raising=False)
    cuda = torch.device("cuda", 0)
    tuning.reload()
    try:
        assert tuning.table_for(0)[0] == "Hopper_GPU"
        assert tuning.tuned_config(cuda, "mla_decode", "k") == {"block_n": 64}
        monkeypatch.setattr(tuning, "_capability", lambda index: "10.0")
        tuning.reload()
        assert tuning.tuned_config(cuda, "mla_decode", "k") is None  # no table of its kind: built-ins
        monkeypatch.setenv("WIDEEP_TUNED_TABLE", "Ampere_GPU")
        tuning.reload()
        assert tuning.tuned_config(cuda, "mla_decode", "k") == {"block_n": 16}
        monkeypatch.setenv("WIDEEP_TUNED_TABLE", "none")
        monkeypatch.setattr(tuning, "_stem", lambda index: "Hopper_GPU")  # even its own table is dropped
        tuning.reload()
        assert tuning.tuned_config(cuda, "mla_decode", "k") is None
        monkeypatch.setenv("WIDEEP_TUNED_TABLE", "No_Such_GPU")
        tuning.reload()
        with pytest.raises(ValueError, match="WIDEEP_TUNED_TABLE"):
            tuning.tuned_config(cuda, "mla_decode", "k")
    finally:
        monkeypatch.delenv("WIDEEP_TUNED_TABLE", raising=False)
        tuning.reload()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [4, 40])
@pytest.mark.parametrize("config", [None, dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1,
                                               keys_rows=True)])
def test_ring_window_read_and_written_in_the_kernel(device, heads, config):
    """`ring`: the window read straight from the ring slab plus the fresh latent, and the fresh
    latent written into the ring, against the reference (which gathers, concatenates and writes
    with torch). 40 heads make two head-group programs share a sequence's window."""
    torch.manual_seed(11)
    g_lens, w = [9, 30, 3], 4
    q, kv, table, lens = make_case(g_lens, heads, torch.bfloat16, device, seed=7)
    ring_kv = torch.randn(5, w, D).to(torch.bfloat16).to(device)
    slots = torch.tensor([3, 0, 4]).to(device)
    fresh = torch.randn(3, D).to(torch.bfloat16).to(device)
    write_idx = torch.tensor([1, 3, 0]).to(device)
    # the entry being overwritten is outside the window (masked), the fresh latent always valid
    valid = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 0, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool).to(device)
    ring_ref, before = ring_kv.clone(), ring_kv.clone()
    out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_valid=valid,
                            ring=(ring_kv, slots, fresh, write_idx), num_splits=2, config=config)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_valid=valid,
                               ring=(ring_ref, slots, fresh, write_idx))
    check(out, ref, torch.bfloat16)
    assert torch.equal(ring_kv, ring_ref)
    assert torch.equal(ring_kv[slots, write_idx], fresh)
    untouched = torch.ones(5, w, dtype=torch.bool)
    untouched[slots.cpu(), write_idx.cpu()] = False
    assert torch.equal(ring_kv[untouched.to(device)], before[untouched.to(device)])
    # the same window passed as win_kv gives the same output
    win = torch.cat([ring_ref[slots].clone(), fresh[:, None]], dim=1)
    win[torch.arange(3), write_idx] = torch.randn(3, D).to(torch.bfloat16).to(device)  # masked: any value
    check(mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win, win_valid=valid,
                            num_splits=2), ref, torch.bfloat16)
    with pytest.raises(ValueError, match="not both"):
        mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win,
                          ring=(ring_kv, slots, fresh, write_idx))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", [None, dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1,
                                               keys_rows=True)])
def test_ring_window_of_prompt_chunk_rows(device, config):
    """Prompt-chunk rows (write_idx None): each row reads its sequence's ring in place and F fresh
    latents, fresh[b], fresh[b-1], ... (the chunk's rows before it); nothing is written. The
    same as the gathered window passed as win_kv; a ring write asks for one fresh latent a row."""
    torch.manual_seed(13)
    g_lens, w, f = [9, 30, 3, 17, 1], 4, 3
    b = len(g_lens)
    q, kv, table, lens = make_case(g_lens, 4, torch.bfloat16, device, seed=8)
    ring_kv = torch.randn(3, w, D).to(torch.bfloat16).to(device)
    slots = torch.tensor([2, 2, 0, 0, 1]).to(device)  # rows 0-1 one sequence's, 2-3 another's
    fresh = torch.randn(b, D).to(torch.bfloat16).to(device)
    back = torch.arange(b)[:, None] - torch.arange(f)
    valid = torch.rand(b, w + f, generator=torch.Generator().manual_seed(2)) > 0.3
    valid[:, w:] &= back >= 0
    valid = valid.to(device)
    before = ring_kv.clone()
    out = mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_valid=valid,
                            ring=(ring_kv, slots, fresh, None), num_splits=2, config=config)
    win = torch.cat([ring_kv[slots], fresh[back.clamp(min=0).to(device)]], dim=1)
    ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_kv=win, win_valid=valid)
    check(out, ref, torch.bfloat16)
    check(mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_valid=valid,
                               ring=(ring_kv, slots, fresh, None)), ref, torch.bfloat16)
    assert torch.equal(ring_kv, before)
    with pytest.raises(ValueError, match="one fresh latent"):
        mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, win_valid=valid,
                          ring=(ring_kv, slots, fresh, torch.zeros(b, dtype=torch.long, device=device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 3, 7, None])
def test_keys_rows_splits_cover_global_then_window_keys(device, num_splits):
    """The keys-as-rows kernel deals a row's tiles (its global ones, then its window ones) to the
    splits in turn, so a split may hold global and window tiles, or window tiles only, or none;
    the ring entry is written once. Also with a table far wider than every row (a CUDA graph's
    shared width)."""
    torch.manual_seed(12)
    g_lens, w = [70, 9, 33], 37
    q, kv, table, lens = make_case(g_lens, 16, torch.bfloat16, device, seed=9)
    topk = torch.randint(-1, 70, (3, 40), dtype=torch.int32).to(device)
    ring_kv = torch.randn(3, w, D).to(torch.bfloat16).to(device)
    slots, write_idx = torch.tensor([2, 0, 1]).to(device), torch.tensor([5, 36, 0]).to(device)
    fresh = torch.randn(3, D).to(torch.bfloat16).to(device)
    valid = torch.rand(3, w + 1, generator=torch.Generator().manual_seed(1)) > 0.3
    valid[torch.arange(3), write_idx.cpu()] = False
    valid = valid.to(device)
    config = dict(block_n=16, num_warps=4, num_stages=2, waves=1, min_tiles=1, keys_rows=True)
    wide = torch.cat([table, table.new_zeros(3, 20)], dim=1)
    for pos, tab in ((None, table), (topk, table), (None, wide)):
        ring_ref, ring_out = ring_kv.clone(), ring_kv.clone()
        out = mla_decode_triton(q, kv, None, tab, lens, BS, SCALE, KV_LORA, topk_pos=pos, win_valid=valid,
                                ring=(ring_out, slots, fresh, write_idx), num_splits=num_splits, config=config)
        ref = mla_decode_reference(q, kv, None, table, lens, BS, SCALE, KV_LORA, topk_pos=pos, win_valid=valid,
                                   ring=(ring_ref, slots, fresh, write_idx))
        check(out, ref, torch.bfloat16)
        assert torch.equal(ring_out, ring_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_query_given_as_two_parts(device):
    """(q_lat, q_rope) as the model makes them (the latent part a permuted view of its bmm)
    gives what the concatenated query gives."""
    q, kv, table, lens = make_case([9, 30], 4, torch.bfloat16, device, seed=8)
    q_lat = q[..., :KV_LORA].transpose(0, 1).contiguous().transpose(0, 1)  # [B, H, C], strides of [H, B, C]
    q_rope = q[..., KV_LORA:]
    assert not q_lat.is_contiguous()
    out = mla_decode_triton((q_lat, q_rope), kv, None, table, lens, BS, SCALE, KV_LORA, num_splits=2)
    assert torch.equal(out, mla_decode_triton(q, kv, None, table, lens, BS, SCALE, KV_LORA, num_splits=2))
    check(out, mla_decode_reference((q_lat, q_rope), kv, None, table, lens, BS, SCALE, KV_LORA), torch.bfloat16)
    # the dispatcher takes the pair too, whichever path it picks
    assert torch.equal(mla_decode((q_lat, q_rope), kv, None, table, lens, BS, SCALE, KV_LORA),
                       mla_decode(q, kv, None, table, lens, BS, SCALE, KV_LORA))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_fp8", [False, True])
def test_warm_up_runs_every_bucket_and_variant(device, kv_fp8, monkeypatch):
    """warm_up launches the kernel (interpreted here) once per batch bucket up to max_batch, in
    the top-k and dense variants, with the window's ring written (decode) and not (prefill rows,
    a window of fresh latents each)."""
    from wideep_kernels import mla_decode as mod
    monkeypatch.setenv("WIDEEP_CPU_KERNELS", "1")
    seen = []
    real = mod.mla_decode_triton
    monkeypatch.setattr(mod, "mla_decode_triton", lambda q, *a, **k: seen.append(
        (q.shape[0], a[7] is not None, k["ring"][3] is not None, a[9].shape[1], a[0].dtype)) or real(q, *a, **k))
    kv_dtype = mod.FP8_DTYPE if kv_fp8 else torch.bfloat16
    mod.warm_up(4, KV_LORA, ROPE, torch.bfloat16, kv_dtype, device, max_batch=20, topk=16, window=8, block_size=BS)
    assert [(b, topk, writes, n_win) for b, topk, writes, n_win, _ in seen] == [
        (b, t, w, 9 if w else 16) for b in (1, 4, 16, 64) for t in (False, True) for w in (True, False)]
    assert all(dt == kv_dtype for *_, dt in seen)


def _gluon_case(device, heads, g_lens, topk_n, w, seed):
    gen = torch.Generator().manual_seed(seed)
    q, kv, table, lens = make_case(g_lens, heads, torch.bfloat16, device, seed=seed, kv_lora=512, rope=64)
    b = len(g_lens)
    # entries past a sequence's length and -1 are no key; the rest repeat or not at random
    topk = torch.randint(-1, max(g_lens) + 3, (b, topk_n), generator=gen, dtype=torch.int32).to(device)
    ring_kv = torch.randn(b + 2, w, 576, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.randperm(b + 2, generator=gen)[:b].to(device)
    write_idx = torch.randint(0, w, (b,), generator=gen).to(device)
    fresh = torch.randn(b, 576, generator=gen).to(torch.bfloat16).to(device)
    valid = torch.rand(b, w + 1, generator=gen) > 0.3
    valid[torch.arange(b), write_idx.cpu()] = False
    return q, kv, table, lens, topk, (ring_kv, slots, fresh, write_idx), valid.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [16, 5])
@pytest.mark.parametrize("num_warps", [4, 8])
@pytest.mark.parametrize("num_splits", [1, 3, 7, None])
@pytest.mark.parametrize("fp8", [False, True])
def test_gluon_split_kernel(device, heads, num_warps, num_splits, fp8):
    """The Gluon split kernel (wideep_kernels/mla_decode_gluon.py, Hopper only) against the reference:
    top-k entries that are -1, past the length or repeated, a ring window with masked entries
    read in place and written, splits holding global tiles, window tiles or both (200 top-k
    entries: a partial last global tile); bf16 and FP8 global keys (the window stays bf16).
    Elsewhere the same configuration runs the Triton kernels, which must give the same answer."""
    from wideep_kernels import _unusable
    g_lens, w = [150, 9, 300, 64], 100
    q, kv, table, lens, topk, ring, valid = _gluon_case(device, heads, g_lens, 200, w, seed=13)
    kv_scale = None
    if fp8:
        kv, kv_scale = quantize_kv(kv)
    config = dict(block_n=64, num_warps=num_warps, num_stages=2, waves=1, min_tiles=1, keys_rows=True, gluon=True)
    on_hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    assert mla_module.gluon_applies(q[..., :512], kv, config, 16, ring[0]) == on_hopper
    scale = 576 ** -0.5
    ring_out, ring_ref = ring[0].clone(), ring[0].clone()
    out = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_valid=valid,
                            ring=(ring_out,) + ring[1:], num_splits=num_splits, config=config)
    ref = mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_valid=valid,
                               ring=(ring_ref,) + ring[1:])
    assert "mla_decode_gluon" not in _unusable
    check(out, ref, torch.bfloat16)
    assert torch.equal(ring_out, ring_ref)
    # top-k positions resolved to slots inside the kernel (no resolve launch) give the same
    ring_out = ring[0].clone()
    out_pos = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_valid=valid,
                                ring=(ring_out,) + ring[1:], num_splits=num_splits, config=dict(config, slots=False))
    check(out_pos, ref, torch.bfloat16)
    assert torch.equal(ring_out, ring_ref)
    # the window passed as rows (as prefill chunks pass it) gives the same
    win = torch.cat([ring[0][ring[1]], ring[2][:, None]], dim=1)
    out_rows = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_kv=win,
                                 win_valid=valid, num_splits=num_splits, config=config)
    check(out_rows, ref, torch.bfloat16)
    # no window at all
    out_g = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, num_splits=num_splits,
                              config=config)
    check(out_g, mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk), torch.bfloat16)
    # dense rows (every position below the length, through the block table), with and without the ring
    ring_out, ring_ref = ring[0].clone(), ring[0].clone()
    out_d = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, win_valid=valid,
                              ring=(ring_out,) + ring[1:], num_splits=num_splits, config=config)
    check(out_d, mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512, win_valid=valid,
                                      ring=(ring_ref,) + ring[1:]), torch.bfloat16)
    assert torch.equal(ring_out, ring_ref)
    check(mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, num_splits=num_splits, config=config),
          mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512), torch.bfloat16)
    # a table far wider than every row (a CUDA graph's shared width): splits of only padding, the
    # window's tiles in a split past them
    wide = torch.cat([table, table.new_zeros(len(g_lens), 40)], dim=1)
    ring_out, ring_ref = ring[0].clone(), ring[0].clone()
    out_w = mla_decode_triton(q, kv, kv_scale, wide, lens, BS, scale, 512, win_valid=valid,
                              ring=(ring_out,) + ring[1:], num_splits=num_splits, config=config)
    check(out_w, mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512, win_valid=valid,
                                      ring=(ring_ref,) + ring[1:]), torch.bfloat16)
    assert torch.equal(ring_out, ring_ref)
    if device == "cuda":  # (on CPU test_ring_window_of_prompt_chunk_rows covers the Triton kernels)
        # prompt-chunk rows: the ring read in place with three fresh latents a row, nothing written
        back = torch.arange(len(g_lens))[:, None] - torch.arange(3)
        fresh_ok = (torch.rand(len(g_lens), 3, generator=torch.Generator().manual_seed(3)) > 0.3) & (back >= 0)
        valid_c = torch.cat([valid[:, :w].cpu(), fresh_ok], dim=1).to(device)
        ring_out = ring[0].clone()
        out_c = mla_decode_triton(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_valid=valid_c,
                                  ring=(ring_out, ring[1], ring[2], None), num_splits=num_splits, config=config)
        win_c = torch.cat([ring[0][ring[1]], ring[2][back.clamp(min=0).to(device)]], dim=1)
        check(out_c, mla_decode_reference(q, kv, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, win_kv=win_c,
                                          win_valid=valid_c), torch.bfloat16)
        assert torch.equal(ring_out, ring[0])
    # a row with no key at all gives zeros (at one split the kernel writes the output itself)
    empty = lens.clone()
    empty[1] = 0
    out_z = mla_decode_triton(q, kv, kv_scale, table, empty, BS, scale, 512, topk_pos=topk, num_splits=num_splits,
                              config=config)
    assert torch.equal(out_z[1], torch.zeros_like(out_z[1]))
    check(out_z, mla_decode_reference(q, kv, kv_scale, table, empty, BS, scale, 512, topk_pos=topk), torch.bfloat16)
    assert "mla_decode_gluon" not in _unusable


@pytest.mark.parametrize("device", DEVICES)
def test_gluon_override_and_where_it_does_not_apply(device, monkeypatch):
    """GLUON_OVERRIDE forces the Gluon kernel on or off whatever the configuration says; head
    groups over 16, rows off 16 bytes and window rows not of the query's type never take it (they
    run the Triton kernels, with the same answer)."""
    q, kv, table, lens, topk, ring, valid = _gluon_case(device, 16, [70, 130], 128, 8, seed=14)
    on_hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    plain = dict(block_n=64, num_warps=4, num_stages=2, waves=1, min_tiles=1, keys_rows=True)
    assert not mla_module.gluon_applies(q[..., :512], kv, plain, 16, None)
    monkeypatch.setattr(mla_decode_gluon, "GLUON_OVERRIDE", True)
    assert mla_module.gluon_applies(q[..., :512], kv, plain, 16, None) == on_hopper
    assert mla_module.gluon_applies(q[..., :512], kv, plain, 16, None, kv) == on_hopper
    assert not mla_module.gluon_applies(q[..., :512], kv, plain, 16, None, kv[:, 1:])  # rows off 16 bytes
    assert not mla_module.gluon_applies(q[..., :512], kv, plain, 32, None)  # more than 16 heads a group
    kv8, kv_scale = quantize_kv(kv)
    assert mla_module.gluon_applies(q[..., :512], kv8, plain, 16, None) == on_hopper
    assert not mla_module.gluon_applies(q[..., :512], kv8, plain, 16, kv.float())  # window rows not bf16
    scale = 576 ** -0.5
    ref = mla_decode_reference(q, kv, None, table, lens, BS, scale, 512, topk_pos=topk)
    check(mla_decode_triton(q, kv, None, table, lens, BS, scale, 512, topk_pos=topk, config=plain), ref,
          torch.bfloat16)
    monkeypatch.setattr(mla_decode_gluon, "GLUON_OVERRIDE", False)
    assert not mla_module.gluon_applies(q[..., :512], kv, dict(plain, gluon=True), 16, None)
    check(mla_decode_triton(q, kv, None, table, lens, BS, scale, 512, topk_pos=topk, config=dict(plain, gluon=True)),
          ref, torch.bfloat16)


class _LaunchSpy:
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("device", DEVICES)
def test_gluon_entry_where_gluon_cannot_run_takes_the_built_in_choice(device, monkeypatch):
    """A tuned Gluon entry (64-key tiles as rows) on a GPU or Triton where the Gluon kernel cannot
    run must not run the Triton keys-as-rows kernel with that entry's numbers (with FP8 keys its
    builds spill): the built-in choice runs instead, heads as rows."""
    q, kv, table, lens, topk, ring, valid = _gluon_case(device, 16, [70, 130], 128, 8, seed=15)
    kv8, kv_scale = quantize_kv(kv)
    entry = dict(block_n=64, num_warps=4, num_stages=2, waves=1, min_tiles=4, keys_rows=True, gluon=True)
    on_hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    heads, rows = _LaunchSpy(mla_module._split_kernel), _LaunchSpy(mla_module._rows_split_kernel)
    monkeypatch.setattr(mla_module, "_split_kernel", heads)
    monkeypatch.setattr(mla_module, "_rows_split_kernel", rows)
    scale = 576 ** -0.5
    out = mla_decode_triton(q, kv8, kv_scale, table, lens, BS, scale, 512, topk_pos=topk, config=entry)
    check(out, mla_decode_reference(q, kv8, kv_scale, table, lens, BS, scale, 512, topk_pos=topk), torch.bfloat16)
    assert rows.launches == 0 and heads.launches == (0 if on_hopper else 1)


def test_gluon_shapes():
    """Which inputs the Gluon kernel takes (checked before any device test): the engine's decode
    shapes (16 heads, 512 + 64 latents, bf16 or FP8 keys, bf16 ring and fresh rows) and no others."""
    from wideep_kernels.fp8_kv import FP8_DTYPE
    q = torch.zeros(4, 16, 512, dtype=torch.bfloat16)
    kv, ring, fresh = (torch.zeros(64, 576, dtype=torch.bfloat16), torch.zeros(4, 128, 576, dtype=torch.bfloat16),
                       torch.zeros(4, 576, dtype=torch.bfloat16))
    ok = mla_decode_gluon.gluon_shapes_ok
    assert ok(q, kv, 16, ring, kv, ring, fresh)
    assert ok(q, kv.to(FP8_DTYPE), 16, ring, kv.to(FP8_DTYPE), ring, fresh)
    assert ok(q, kv, 16, None, kv)  # no window
    assert ok(q.half(), kv.half(), 16, None, kv.half())
    assert not ok(q.float(), kv.float(), 16, None, kv.float())  # fp32 query
    assert not ok(q, kv.half(), 16, None, kv.half())  # keys of another 16-bit type
    assert not ok(q, kv, 16, ring.float(), kv, ring.float())  # window rows not of the query's type
    assert not ok(q, kv, 32, None, kv)  # more than 16 heads a group
    assert not ok(q[..., :448], kv, 16, None, kv)  # a latent of 448
    assert not ok(q, kv[:, :520], 16, None, kv[:, :520])  # a rope of 8
    assert not ok(q, kv, 16, None, kv[:, 1:])  # rows off 16 bytes
    wide = torch.zeros(64, 580, dtype=torch.bfloat16)[:, :576]  # rows of 580: off 16 bytes after the first
    assert not ok(q, wide, 16, None, wide)
