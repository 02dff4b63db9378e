import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernel_devices import poison_empty  # noqa: E402
from wideep_kernels.indexer import (  # noqa: E402
    indexer_scores_reference,
    indexer_scores_triton,
    indexer_topk,
    indexer_topk_reference,
    indexer_topk_triton,
    kth_scores,
    select_topk_reference,
    select_topk_triton,
)

# Triton runs CPU tensors only under the interpreter, which is off where CUDA is present.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(device, g_lens, block_size, heads=4, dim=16, dtype=torch.float32, extra_blocks=1,
              seed=0, shuffle=True):
    """Random inputs whose block tables scatter each sequence over a shared slab."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(g_lens)
    max_blocks = max(1, max(-(-n // block_size) for n in g_lens)) + extra_blocks
    num_slab_blocks = num_seqs * max_blocks + 3
    perm = torch.randperm(num_slab_blocks, generator=g) if shuffle else torch.arange(num_slab_blocks)
    tables = perm[: num_seqs * max_blocks].view(num_seqs, max_blocks).to(torch.int32)
    # Entries past each sequence's last block are junk the kernel must never follow.
    for b, n in enumerate(g_lens):
        tables[b, -(-n // block_size):] = 10**6
    q = torch.randn(num_seqs, heads, dim, generator=g)
    w = torch.randn(num_seqs, heads, generator=g)
    keys = torch.randn(num_slab_blocks * block_size, dim, generator=g)
    lens = torch.tensor(g_lens, dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), w.to(dtype), keys.to(dtype), tables, lens)]


def as_sets(pos):
    return [sorted(p for p in row.tolist() if p >= 0) for row in pos.cpu()]


def check_rows(got, want, g_lens, topk):
    assert got.shape == want.shape == (len(g_lens), topk)
    assert got.dtype == torch.int32
    assert as_sets(got) == as_sets(want)
    for row, n in zip(got.cpu(), g_lens):
        valid = row[row >= 0]
        assert len(valid) == min(n, topk)
        assert len(set(valid.tolist())) == len(valid)
        assert int((row == -1).sum()) == topk - min(n, topk) and not (row < -1).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_lens,block_size,topk", [
    ([37], 8, 5),                 # batch 1, length not a multiple of the block
    ([64, 1, 100, 17], 16, 12),   # mixed lengths, one shorter than topk
    ([40, 40, 23], 4, 64),        # topk wider than every row: all positions, rest -1
    ([0, 50, 0], 8, 7),           # empty sequences: all -1
    ([200, 130], 64, 33),         # several tiles per row
])
def test_topk_matches_reference(device, g_lens, block_size, topk):
    args = make_case(device, g_lens, block_size)
    want = indexer_topk_reference(*args, block_size, topk)
    got = indexer_topk_triton(*args, block_size, topk)
    check_rows(got, want, g_lens, topk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["fused", "radix"])
def test_selection_workspace_is_cleared_by_the_scoring(device, method, monkeypatch):
    """The selection's workspace comes from torch.empty and is zeroed by the scoring launch."""
    import wideep_kernels.indexer as mod
    if method == "radix":
        monkeypatch.setattr(mod, "FUSED_MAX_WIDTH", 0)
    else:
        monkeypatch.setattr(mod, "FUSED_MIN_ROWS", 1)
    assert mod.default_select(1024, 2) == method
    poison_empty(monkeypatch)
    g_lens = [1000, 70]
    args = make_case(device, g_lens, 64)
    want = indexer_topk_reference(*args, 64, 33)
    got = indexer_topk_triton(*args, 64, 33)
    check_rows(got, want, g_lens, 33)


@pytest.mark.parametrize("device", DEVICES)
def test_scores_match_reference(device):
    g_lens = [45, 3, 0, 70]
    args = make_case(device, g_lens, 8, heads=3, dim=24)  # heads and dim not powers of two
    want = indexer_scores_reference(*args, 8)
    got = indexer_scores_triton(*args, 8)
    assert got.shape == want.shape and got.dtype == torch.float32
    live = torch.isfinite(want)
    assert int(live.sum()) == sum(g_lens)
    assert torch.equal(torch.isinf(got), ~live)
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_inputs(device):
    g_lens = [90, 31]
    args = make_case(device, g_lens, 16, heads=8, dim=32, dtype=torch.bfloat16, seed=3)
    want = indexer_topk_reference(*args, 16, 20)
    got = indexer_topk_triton(*args, 16, 20)
    check_rows(got, want, g_lens, 20)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_score_ties_prefer_later_positions(device):
    """Most keys point away from every query head: relu makes their scores exactly 0 (or -0.0
    where a head weight is negative), and the top-k must take the latest of them."""
    g_lens = [100, 61]
    block_size, topk = 8, 30
    q, w, keys, tables, lens = make_case(device, g_lens, block_size, heads=4, dim=16, seed=5)
    q = q.abs()
    w[0] = w[0].abs()
    w[1] = torch.tensor([1.0, -1.0, 0.5, -2.0], device=device)
    keys = -keys.abs()
    positive = torch.zeros(keys.shape[0], dtype=torch.bool)
    # A few positions with a positive score in each sequence, fewer than topk.
    for b, n in enumerate(g_lens):
        for j in (3, n // 2, n - 20):
            slot = int(tables[b, j // block_size]) * block_size + j % block_size
            positive[slot] = True
    keys[positive.to(device)] = keys[positive.to(device)].abs()
    args = (q, w, keys, tables, lens)
    want = indexer_topk_reference(*args, block_size, topk)
    got = indexer_topk_triton(*args, block_size, topk)
    check_rows(got, want, g_lens, topk)
    # Row 0: 3 positive scores, then the latest zero-score positions.
    zeros_taken = sorted(set(as_sets(got)[0]) - {3, 50, 80})
    assert zeros_taken == [j for j in range(100 - 28, 100) if j != 80]


@pytest.mark.parametrize("device", DEVICES)
def test_contiguous_and_shared_tables(device):
    """Two sequences reading the same physical blocks (a shared prefix) score them identically."""
    block_size, topk = 4, 6
    q, w, keys, tables, lens = make_case(device, [21, 21], block_size, shuffle=False, seed=7)
    tables[1] = tables[0]
    q[1], w[1] = q[0], w[0]
    got = indexer_topk_triton(q, w, keys, tables, lens, block_size, topk)
    want = indexer_topk_reference(q, w, keys, tables, lens, block_size, topk)
    check_rows(got, want, [21, 21], topk)
    assert as_sets(got)[0] == as_sets(got)[1]


@pytest.mark.parametrize("device", DEVICES)
def test_negative_weights_order_negative_scores(device):
    """All head weights negative: every score is <= 0 and the best are the least negative."""
    g_lens = [77, 130]
    q, w, keys, tables, lens = make_case(device, g_lens, 16, seed=11)
    w = -w.abs()
    want = indexer_topk_reference(q, w, keys, tables, lens, 16, 40)
    got = indexer_topk_triton(q, w, keys, tables, lens, 16, 40)
    check_rows(got, want, g_lens, 40)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["fused", "radix", "threshold", "topk"])
@pytest.mark.parametrize("width,topk,chunk", [(100, 10, 16), (100, 60, 16), (64, 64, 16), (37, 50, 16), (300, 7, 32),
                                                (300, 90, 4)])
def test_selection_with_many_ties_across_chunks(device, width, topk, chunk, method, monkeypatch):
    """Scores from a handful of values, so the k-th score is shared by positions in several
    chunks: exactly the latest of them must fill the places left."""
    import wideep_kernels.indexer as mod
    # The emit sums the chunk counts 16 a step here, so 300 / 4 = 75 chunks take several steps
    # (the real 1024 a step only loops past 1M positions, too wide for the interpreter).
    monkeypatch.setattr(mod, "_EMIT_SUMS", 16)
    g = torch.Generator().manual_seed(width + topk)
    scores = torch.randint(-2, 3, (4, width), generator=g).float()
    scores[1] = 0.0
    scores[2, ::3] = -0.0  # ties with +0.0, as floats do
    g_lens = torch.tensor([width, width - 5, width // 2, 0], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    scores, g_lens = scores.to(device), g_lens.to(device)
    want = select_topk_reference(scores, g_lens, topk)
    got = select_topk_triton(scores, g_lens, topk, chunk=chunk, method=method)
    check_rows(got, want, g_lens.tolist(), topk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("one_emit", [True, False])
@pytest.mark.parametrize("method", ["radix", "threshold"])
def test_emit_after_the_passes_keeps_the_tie_rule(device, one_emit, method, monkeypatch):
    """After the radix or threshold passes, the positions from one launch (ONE_EMIT) or from the
    count, offsets and emit passes: rows whose k-th score is shared by more positions than places
    (the latest kept), by exactly as many (all kept: values whose key's last byte is not 0, so
    the tie count comes from the histogram), and the -0.0 / 0.0 pair as ties; chunks of 16 over
    several programs."""
    import wideep_kernels.indexer as mod
    import wideep_kernels.wide_select as ws
    monkeypatch.setattr(mod, "ONE_EMIT", one_emit)
    monkeypatch.setattr(ws, "CAPACITY", 16)  # the threshold rows overflow into the whole-row passes
    width, topk = 500, 40
    g = torch.Generator().manual_seed(2)
    values = torch.tensor([0.3, 0.7, 1.3, 2.9])
    scores = values[torch.randint(0, 4, (5, width), generator=g)]
    scores[1] = torch.randn(width, generator=g)
    places = torch.randperm(width - 3, generator=g)
    scores[1, places[:37]] = 4 + torch.rand(37, generator=g)
    scores[1, places[37:40]] = 3.3  # the k-th score: 3 ties, all wanted
    scores[2] = torch.where(torch.rand(width, generator=g) < 0.5, 0.0, -0.0)
    scores[2, :30] = 1.1  # the k-th score is zero: 10 of 470 signed zeros, the latest
    scores[3] = torch.randn(width, generator=g)  # no ties
    g_lens = torch.tensor([width, width - 3, width, 417, 33], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    scores, g_lens = scores.to(device), g_lens.to(device)
    want = select_topk_reference(scores, g_lens, topk)
    got = select_topk_triton(scores, g_lens, topk, chunk=16, method=method)
    check_rows(got, want, g_lens.tolist(), topk)


def test_dispatcher_uses_reference_without_triton_device(monkeypatch):
    import wideep_kernels.indexer as mod
    args = make_case(TRITON_DEVICE, [30, 9], 8)
    monkeypatch.setattr(mod, "triton_ok", lambda t: False)
    ref = indexer_topk(*args, 8, 10)
    assert torch.equal(ref, indexer_topk_reference(*args, 8, 10))
    monkeypatch.setattr(mod, "triton_ok", lambda t: True)
    check_rows(indexer_topk(*args, 8, 10), ref, [30, 9], 10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_keys_with_scales(device, q_dtype):
    """FP8 index keys with one scale per slot (the engine's kv_cache_dtype fp8_e4m3): the kernel
    scores (q . k8) * scale; the reference dequantises first."""
    from wideep_kernels.fp8_kv import quantize_kv
    g_lens, bs, topk = [70, 9, 33], 8, 12
    q, w, keys, tables, lens = make_case(device, g_lens, bs, seed=5)
    keys8, scale = quantize_kv(keys.float())
    q = q.to(q_dtype)
    ref = indexer_scores_reference(q, w, keys8, tables, lens, bs, key_scale=scale)
    got = indexer_scores_triton(q, w, keys8, tables, lens, bs, key_scale=scale)
    live = torch.isfinite(ref)
    assert torch.equal(live, torch.isfinite(got))
    tol = 1e-4 if q_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[live], ref[live], atol=tol, rtol=tol)
    # the scales matter: without them the scores differ
    assert not torch.allclose(indexer_scores_reference(q, w, keys8, tables, lens, bs)[live], ref[live])
    if q_dtype == torch.float32:
        check_rows(indexer_topk_triton(q, w, keys8, tables, lens, bs, topk, key_scale=scale),
                   indexer_topk_reference(q, w, keys8, tables, lens, bs, topk, key_scale=scale), g_lens, topk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_scale", [1.0, 2.0 ** 20])
def test_fp8_keys_scored_in_fp16(device, q_scale):
    """FP8 keys with a bf16 query scored in fp16 (FP8_SCORES_IN_F16) give the bf16 path's scores
    (bit for bit under the interpreter), a query past fp16's range (scaled down by a power of two
    and back) included."""
    from wideep_kernels.fp8_kv import quantize_kv
    from wideep_kernels.index_score import _score_launch
    g_lens, bs = [70, 9, 33], 8
    q, w, keys, tables, lens = make_case(device, g_lens, bs, seed=6)
    keys8, scale = quantize_kv(keys.float())
    q = (q.float() * q_scale).bfloat16()
    w = w.bfloat16()
    want = _score_launch(q, w, keys8, tables, lens, bs, key_scale=scale, f16=False)
    got = _score_launch(q, w, keys8, tables, lens, bs, key_scale=scale, f16=True)
    live = torch.isfinite(want)
    assert torch.equal(live, torch.isfinite(got)) and int(live.sum()) == sum(g_lens)
    # products are exact either way; only the fp32 sums' order may differ (tensor-core shapes)
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5 * float(want[live].abs().max()))


def order_keys(scores):
    """The radix passes' order keys (wideep_kernels/row_select.py _order_key) as int64: unsigned order
    is the float order, -0.0 takes 0.0's key."""
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >> 31 != 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse", [True, False])
def test_radix_histograms_are_exact(device, sparse):
    """Every bin of every radix pass counts exactly the keys that share the k-th key's bytes
    before it, bin 0 included (keys that do not match are taken out of it): the one-launch emit
    reads the k-th key's bin as its count of ties. Scores that are small integers and halves
    have keys ending in zero bytes; -inf padding and -0.0 among them; the threshold passes over
    a whole row (a tiny capacity) likewise."""
    import wideep_kernels.radix_select as radix_select
    import wideep_kernels.wide_select as ws
    g = torch.Generator().manual_seed(3)
    width, k = 5000, 300
    scores = torch.randint(-8, 9, (3, width), generator=g).float() / 2
    scores[1] = torch.randn(width, generator=g).round(decimals=1)
    scores[2, 3000:] = float("-inf")
    scores[2, ::7] = -0.0
    keys = order_keys(scores)
    kth = torch.topk(keys, k, dim=1).values[:, -1]
    runs = [radix_select.radix_passes(scores.to(device), k, sparse=sparse)[0]]
    runs.append(ws.threshold_passes(scores.to(device), k, capacity=16)[0])  # every row overflows 16
    for hist in runs:
        hist = hist.cpu()
        for p in range(4):
            shift = 32 - 8 * p
            same = (keys >> shift) == (kth[:, None] >> shift) if p else torch.ones_like(keys, dtype=torch.bool)
            digits = (keys >> (24 - 8 * p)) & 0xFF
            for b in range(3):
                want = torch.bincount(digits[b][same[b]], minlength=256)
                assert torch.equal(hist[p, b].long(), want), (p, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [1, 128])
def test_radix_select_over_several_pass_chunks(device, programs, monkeypatch):
    """Rows longer than one histogram chunk (4096, or 1024 when few rows leave the GPU idle),
    scores sharing their top bytes (one binade, many repeats), negative and -inf ones: every
    radix pass has to narrow the k-th score."""
    import wideep_kernels.radix_select as mod
    monkeypatch.setattr(mod, "_RADIX_PROGRAMS", programs)
    g = torch.Generator().manual_seed(7)
    width, topk = 9000, 300
    scores = 1.0 + torch.randint(0, 2000, (3, width), generator=g).float() / 4096  # [1, 1.5), repeats
    scores[1] = -scores[1]
    scores[2, 4000:] = float("-inf")
    g_lens = torch.tensor([width, width - 17, 4000], dtype=torch.int32)
    scores[torch.arange(width)[None, :] >= g_lens[:, None].long()] = float("-inf")
    scores, g_lens = scores.to(device), g_lens.to(device)
    for method in ("fused", "radix", "threshold"):
        check_rows(select_topk_triton(scores, g_lens, topk, method=method),
                   select_topk_reference(scores, g_lens, topk), g_lens.tolist(), topk)
    for row, k in ((0, 1), (1, topk), (2, width)):  # the k-th score itself, each way
        want = scores[row].sort(descending=True).values[k - 1]
        for method in ("radix", "threshold", "topk"):
            assert kth_scores(scores[row:row + 1], k, method).item() == want.item()


@pytest.mark.parametrize("device", DEVICES)
def test_radix_launch_overrides(device):
    """span / block / warps given by the caller (bench.probe_radix) find the same k-th scores; a
    span that is not a whole number of blocks is refused."""
    g = torch.Generator().manual_seed(8)
    scores = (1.0 + torch.randint(0, 500, (2, 3000), generator=g).float() / 1024).to(device)
    want = scores.sort(dim=1, descending=True).values[:, 299]
    for span, block, warps in ((512, 256, 4), (1024, 512, 8), (4096, 1024, 8)):
        assert torch.equal(kth_scores(scores, 300, "radix", span, block, warps), want)
    with pytest.raises(ValueError, match="multiple of block"):
        kth_scores(scores, 300, "radix", span=768, block=512)


@pytest.mark.parametrize("device", DEVICES)
def test_radix_sparse_blocks_count_as_histograms(device):
    """The last two radix passes' atomics for blocks where few keys still match (RADIX_SPARSE)
    add the same counts as the histograms: a row whose blocks hold few matching keys (distinct
    random scores) and a row whose blocks hold hundreds (repeats of the k-th score)."""
    from wideep_kernels.indexer import radix_passes
    g = torch.Generator().manual_seed(9)
    width, k = 6000, 300
    scores = torch.randn(2, width, generator=g)
    scores[1, 1000:3000] = scores[1].sort(descending=True).values[k - 1]  # 2000 ties: dense blocks
    scores = scores.to(device)
    dense_hist, dense_state = radix_passes(scores, k, span=1024, block=512, sparse=False)
    sparse_hist, sparse_state = radix_passes(scores, k, span=1024, block=512, sparse=True)
    # bin 0 also holds the non-matching keys of histogrammed blocks: never read exactly
    assert torch.equal(dense_hist[..., 1:], sparse_hist[..., 1:]) and torch.equal(dense_state, sparse_state)
    want = scores.sort(dim=1, descending=True).values[:, k - 1]
    assert torch.equal(kth_scores(scores, k, "radix"), want)


def test_unknown_selection_method_is_refused():
    scores = torch.zeros(1, 64, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="unknown selection method"):
        select_topk_triton(scores, torch.tensor([64], dtype=torch.int32), 8, method="row")


@pytest.mark.parametrize("device", DEVICES)
def test_head_weight_scale_in_kernel(device):
    """w_scale multiplies the fp32 head weights inside the kernel: the same scores as scaling
    them beforehand, bit for bit."""
    args = make_case(device, [70, 33], 16, dtype=torch.bfloat16)
    q, w, keys, tables, lens = args
    scale = 8 ** -0.5
    got = indexer_scores_triton(q, w, keys, tables, lens, 16, w_scale=scale)
    want = indexer_scores_triton(q, w.float() * scale, keys, tables, lens, 16)
    assert torch.equal(got, want)
    ref = indexer_scores_reference(q, w, keys, tables, lens, 16, w_scale=scale)
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=1e-2)
    assert not torch.allclose(got, indexer_scores_triton(q, w, keys, tables, lens, 16), atol=1e-3)
