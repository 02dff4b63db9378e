"""The indexer's scoring launch taking several tiles a program and, for the threshold select, the
strided group maxima (wideep_kernels/index_score.py _score_launch, wideep_kernels/wide_select.py threshold_passes):
the same scores as one tile a program, the maxima of a plain torch reduction, and the reference's
selection with the maxima's own launch left out."""
import pytest
import torch

from kernel_devices import DEVICES, poison_empty
import wideep_kernels.index_score as score
import wideep_kernels.indexer as indexer
import wideep_kernels.wide_select as ws
from test_kernel_indexer import check_rows, make_case


def maxima_reference(scores, stride):
    """m[b, t] = max over i of scores[b, t + i * stride], -inf where a group has no position."""
    num_seqs, width = scores.shape
    padded = torch.full((num_seqs, -(-width // stride) * stride), float("-inf"), device=scores.device)
    padded[:, :width] = scores
    return padded.view(num_seqs, -1, stride).amax(dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g_lens,block_size,tile,stride", [
    ([1000, 70, 0], 64, 64, 128),    # 16 tiles a row over 2 programs; a short and an empty row
    ([300], 16, 32, 96),             # width 304: the last pass is partly past the row
    ([40, 33], 8, 16, 64),           # the group stride wider than the rows: one position a group
])
def test_scores_and_maxima_from_one_launch(device, g_lens, block_size, tile, stride):
    args = make_case(device, g_lens, block_size)
    want = score._score_launch(*args, block_size, tile=tile, num_warps=4)
    m = torch.full((len(g_lens), stride), float("nan"), device=device)
    got = score._score_launch(*args, block_size, tile=tile, num_warps=4, maxima=m)
    assert torch.equal(got, want)
    assert torch.equal(m, maxima_reference(want, stride))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("programs", [1, 3, 7, 100])
def test_several_tiles_a_program_give_the_same_scores(device, programs):
    """Also with FP8 keys and their scales (scored in fp16 where q is bf16, on CUDA)."""
    g_lens = [700, 129, 5]
    args = make_case(device, g_lens, 32)
    want = score._score_launch(*args, 32, tile=32, num_warps=4)
    got = score._score_launch(*args, 32, tile=32, num_warps=4, programs=programs)
    assert torch.equal(got, want)
    q, w, keys, tables, lens = args
    keys8 = keys.to(torch.float8_e4m3fn)
    scale = torch.rand(keys.shape[0], device=device) + 0.5
    if device == "cuda":
        q, w = q.bfloat16(), w.bfloat16()
    want = score._score_launch(q, w, keys8, tables, lens, 32, tile=32, num_warps=4, key_scale=scale)
    got = score._score_launch(q, w, keys8, tables, lens, 32, tile=32, num_warps=4, key_scale=scale,
                                programs=programs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("score_maxima,min_programs", [(True, 1), (True, 40), (False, 1)])
def test_threshold_select_with_the_scoring_maxima(device, score_maxima, min_programs, monkeypatch):
    """indexer_topk_triton on the threshold path, its workspace and maxima from torch.empty (full
    of garbage), zeroed and written by the scoring launch; with SCORE_MAXIMA off the maxima's
    own kernel runs. min_programs 40: more groups than the bound needs (wider than the rows)."""
    monkeypatch.setattr(indexer, "FUSED_MAX_WIDTH", 0)
    monkeypatch.setattr(indexer, "THRESHOLD_MIN_POSITIONS", 0)
    monkeypatch.setattr(indexer, "SCORE_MAXIMA", score_maxima)
    monkeypatch.setattr(indexer, "MAXIMA_MIN_PROGRAMS", min_programs)
    launched = []
    real = ws._group_max_kernel
    monkeypatch.setattr(ws, "_group_max_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    poison_empty(monkeypatch)
    g_lens = [1000, 70, 0, 513]
    args = make_case(device, g_lens, 64)
    for topk in (33, 200):
        want = indexer.indexer_topk_reference(*args, 64, topk)
        got = indexer.indexer_topk_triton(*args, 64, topk)
        check_rows(got, want, g_lens, topk)
    assert bool(launched) != score_maxima


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_keys_take_several_tiles_a_program_by_default(device, monkeypatch):
    """FP8 keys are scored by about FP8_SCORE_PROGRAMS programs (here 3 for 2 rows: 2 a row, each
    several tiles), with the scores of one tile a program (to 1e-5: on a GPU the tuned launch may
    have other warps than the probe's, and sum the heads in another order)."""
    g_lens = [700, 129]
    q, w, keys, tables, lens = make_case(device, g_lens, 16)
    keys8 = keys.to(torch.float8_e4m3fn)
    scale = torch.rand(keys.shape[0], device=device) + 0.5
    if device == "cuda":
        q, w = q.bfloat16(), w.bfloat16()
    launched = []
    real = score._score_tile_kernel
    monkeypatch.setattr(score, "_score_tile_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launched.append(grid) or real[grid]})())
    monkeypatch.setattr(score, "FP8_SCORE_PROGRAMS", 3)
    got = score._score_launch(q, w, keys8, tables, lens, 16, key_scale=scale)
    row_tiles = -(-tables.shape[1] * 16 // 128)
    want = score._score_launch(q, w, keys8, tables, lens, 16, tile=128, num_warps=4, key_scale=scale,
                                 programs=row_tiles)
    assert launched[0] == (2, 2) and launched[1] == (2, row_tiles)
    live = torch.isfinite(want)
    assert torch.equal(live, torch.isfinite(got))
    assert float((got - want)[live].abs().max()) <= 1e-5 * float(want[live].abs().max())


def test_bad_maxima_are_refused():
    args = make_case("cpu", [100], 16)
    with pytest.raises(ValueError, match="multiple of the tile"):
        score._score_launch(*args, 16, tile=32, maxima=torch.empty(1, 48))
    with pytest.raises(ValueError, match="maxima must be"):
        score._score_launch(*args, 16, tile=32, maxima=torch.empty(2, 64))
    scores = torch.zeros(1, 128)
    with pytest.raises(ValueError, match="come together"):
        ws.threshold_passes(scores, 8, maxima=torch.zeros(1, 64))
    with pytest.raises(ValueError, match="T >= k"):
        ws.threshold_passes(scores, 8, maxima=torch.zeros(1, 4), ws=ws.threshold_workspace(1, "cpu"))


def compiled_variants() -> dict[str, set]:
    """The build keys held by each Triton kernel of the indexer's modules (all devices), by name,
    so that a failure names the kernel that built again and the variant it built."""
    import wideep_kernels.radix_select as radix_select
    import wideep_kernels.row_select as row_select
    from triton.runtime.jit import JITFunction
    builds = {}
    for module in (score, indexer, ws, row_select, radix_select):
        for name, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", None)
                if caches is None:
                    pytest.skip("this Triton keeps no per-device kernel cache to count")
                builds[f"{module.__name__}.{name}"] = {str(key) for entry in caches.values() for key in entry[0]}
    return builds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_warm_up_builds_the_wide_rows_variants(fp8):
    """After one short scoring call (as the engine's warm-up requests make) and warm_up, rows of
    other wide shapes (the one-launch select with FP8 keys looping, the radix passes with one
    tile a program and with several, the threshold select with the maxima) build nothing new."""
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, dim, bs, topk = 8, 64, 64, 2048

    def call(rows, width):
        q = torch.randn(rows, heads, dim, device="cuda", generator=g).bfloat16()
        w = torch.randn(rows, heads, device="cuda", generator=g).bfloat16()
        blocks = width // bs
        keys = torch.randn(blocks * bs, dim, device="cuda", generator=g).bfloat16()
        scale = None
        if fp8:
            keys, scale = keys.to(torch.float8_e4m3fn), torch.rand(blocks * bs, device="cuda") + 0.5
        tables = torch.randint(0, blocks, (rows, blocks), device="cuda", generator=g, dtype=torch.int32)
        lens = torch.full((rows,), width, device="cuda", dtype=torch.int32)
        return indexer.indexer_topk_triton(q, w, keys, tables, lens, bs, topk, key_scale=scale, w_scale=0.35)

    call(3, 4096)
    indexer.warm_up(topk, "cuda", 16)
    before = compiled_variants()
    for rows, width in [(12, 32768), (2, 65536), (8, 131072 + 5 * bs), (16, 262144)]:
        out = call(rows, width)
        assert out.shape == (rows, topk) and bool((out >= 0).all())
    after = compiled_variants()
    assert {name: after[name] - keys for name, keys in before.items() if after[name] != keys} == {}
