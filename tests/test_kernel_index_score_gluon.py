"""The Gluon scoring kernel for FP8 index keys (kernels/index_score_gluon.py, Hopper only) against
the Triton kernel's fp16 form and the reference, and where the dispatcher takes it."""
import pytest
import torch

from kernels import _unusable
from kernels import index_score
from kernels.fp8_kv import quantize_kv
from kernels.index_score import _score_launch
from kernels.index_score_gluon import gluon, gluon_scoring_applies
from kernels.indexer import indexer_scores_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and gluon is not None
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and Triton's Gluon")


def _case(g_lens, block_size, heads=8, dim=64, seed=0, device="cuda"):
    """bf16 query and weights, E4M3 keys with scales, block tables scattered over a shared pool
    (entries past a row's last block are junk that must never be followed)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // block_size) for n in g_lens)) + 1
    pool_blocks = len(g_lens) * max_blocks + 3
    tables = torch.randperm(pool_blocks, generator=g)[: len(g_lens) * max_blocks].view(len(g_lens), max_blocks)
    tables = tables.to(torch.int32)
    for b, n in enumerate(g_lens):
        tables[b, -(-n // block_size):] = 10**6
    q = torch.randn(len(g_lens), heads, dim, generator=g).bfloat16()
    w = torch.randn(len(g_lens), heads, generator=g).bfloat16()
    keys8, scale = quantize_kv(torch.randn(pool_blocks * block_size, dim, generator=g))
    lens = torch.tensor(g_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, w, keys8, scale, tables, lens)]


def _close(got, want):
    live = torch.isfinite(want)
    assert torch.equal(live, torch.isfinite(got))
    if live.any():
        # products are exact in fp16 either way; only the fp32 sums' order may differ
        torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5 * float(want[live].abs().max()))


def test_applies_only_to_what_it_takes():
    """Never on CPU tensors, bf16 keys, more than 16 heads or a head dim that is no power of two."""
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    keys8, scale = quantize_kv(torch.randn(64, 64))
    assert not gluon_scoring_applies(q, keys8, scale)  # CPU
    if HOPPER:
        qc, kc, sc = q.cuda(), keys8.cuda(), scale.cuda()
        assert gluon_scoring_applies(qc, kc, sc)
        assert not gluon_scoring_applies(qc, kc.bfloat16(), None)
        assert not gluon_scoring_applies(qc.float(), kc, sc)
        assert not gluon_scoring_applies(torch.zeros(2, 32, 64, dtype=torch.bfloat16, device="cuda"), kc, sc)
        k48, s48 = quantize_kv(torch.randn(64, 48, device="cuda"))
        assert not gluon_scoring_applies(torch.zeros(2, 8, 48, dtype=torch.bfloat16, device="cuda"), k48, s48)


@needs_hopper
@pytest.mark.parametrize("g_lens,block_size", [
    ([37], 8),                              # one partial tile
    ([0, 1, 127, 128, 129], 16),            # empty rows and tile edges
    ([5000, 300, 4096], 64),                # several tiles a program, dead tiles in short rows
])
@pytest.mark.parametrize("tile,warps,nbuf,programs", [
    (128, 4, 4, None), (128, 2, 2, 3), (64, 2, 6, 5), (256, 8, 3, 2), (128, 4, 4, 1),
])
def test_scores_match_the_triton_kernel(g_lens, block_size, tile, warps, nbuf, programs):
    q, w, keys8, scale, tables, lens = _case(g_lens, block_size, seed=len(g_lens) + tile)
    want = _score_launch(q, w, keys8, tables, lens, block_size, key_scale=scale, f16=True, gluon=False, w_scale=0.3)
    ref = indexer_scores_reference(q, w, keys8, tables, lens, block_size, key_scale=scale, w_scale=0.3)
    got = _score_launch(q, w, keys8, tables, lens, block_size, tile=tile, num_warps=warps, programs=programs,
                        key_scale=scale, f16=True, gluon=True, nbuf=nbuf, w_scale=0.3)
    _close(got, want)
    live = torch.isfinite(ref)
    torch.testing.assert_close(got[live], ref[live], rtol=3e-2, atol=3e-2)


@needs_hopper
@pytest.mark.parametrize("heads,dim", [(4, 16), (16, 128), (1, 32)])
def test_head_shapes(heads, dim):
    q, w, keys8, scale, tables, lens = _case([900, 33], 16, heads=heads, dim=dim, seed=heads)
    want = _score_launch(q, w, keys8, tables, lens, 16, key_scale=scale, f16=True, gluon=False)
    _close(_score_launch(q, w, keys8, tables, lens, 16, key_scale=scale, f16=True, gluon=True), want)


@needs_hopper
def test_query_past_fp16_range():
    """The query is scaled by a power of two into fp16 and back, as in the Triton kernel."""
    q, w, keys8, scale, tables, lens = _case([700], 16, seed=3)
    q = (q.float() * 2.0 ** 20).bfloat16()
    want = _score_launch(q, w, keys8, tables, lens, 16, key_scale=scale, f16=True, gluon=False)
    got = _score_launch(q, w, keys8, tables, lens, 16, key_scale=scale, f16=True, gluon=True)
    _close(got, want)


@needs_hopper
def test_workspace_zeroed_dead_tiles_skipped_and_maxima():
    """ZERO clears the selection's workspace (a share each program), SKIP_DEAD leaves programs whose
    first tile is past g_len, and MAXIMA writes the strided group maxima of the scores."""
    g_lens = [3000, 100, 0]
    q, w, keys8, scale, tables, lens = _case(g_lens, 64, seed=9)
    zero = torch.full((3, 700), 7, dtype=torch.int32, device="cuda")
    got = _score_launch(q, w, keys8, tables, lens, 64, key_scale=scale, f16=True, gluon=True, zero=zero,
                        skip_dead=True)
    assert not zero.any()
    want = _score_launch(q, w, keys8, tables, lens, 64, key_scale=scale, f16=True, gluon=False)
    for b, n in enumerate(g_lens):
        _close(got[b, :n], want[b, :n])
    stride = 1024  # a multiple of the tile: 8 programs a row
    m = torch.empty(3, stride, device="cuda")
    got = _score_launch(q, w, keys8, tables, lens, 64, key_scale=scale, f16=True, gluon=True, maxima=m)
    _close(got, want)
    width = got.shape[1]
    padded = torch.full((3, -(-width // stride) * stride), float("-inf"), device="cuda")
    padded[:, :width] = got
    assert torch.equal(m, padded.view(3, -1, stride).amax(dim=1))


@needs_hopper
def test_dispatcher_takes_it_and_falls_back(monkeypatch):
    """FP8 keys with a bf16 query take the Gluon kernel by default; if it fails to build or launch,
    the Triton kernel scores from then on (warned once), with the same scores."""
    q, w, keys8, scale, tables, lens = _case([2000], 64, seed=4)
    want = _score_launch(q, w, keys8, tables, lens, 64, key_scale=scale, gluon=False)
    calls = []
    real = index_score.score_gluon
    monkeypatch.setattr(index_score, "score_gluon", lambda *a, **k: (calls.append(1), real(*a, **k)))
    _close(_score_launch(q, w, keys8, tables, lens, 64, key_scale=scale), want)
    assert calls

    def broken(*a, **k):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(index_score, "score_gluon", broken)
    try:
        _close(_score_launch(q, w, keys8, tables, lens, 64, key_scale=scale), want)
        assert "index_score_gluon" in _unusable
        assert not gluon_scoring_applies(q, keys8, scale)
    finally:
        _unusable.discard("index_score_gluon")
