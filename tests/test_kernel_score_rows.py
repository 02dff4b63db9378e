"""The indexer's scoring of prompt rows several to a program (wideep_kernels/index_score_rows.py):
the groups of a step's rows, the reference's scores for every group (a chunk's, a decoding row's
alone), with every flag the row-by-row launch takes (workspace zeroing, dead tiles skipped, group
maxima, FP8 keys), and the selection through indexer_topk unchanged."""
import pytest
import torch

from kernel_devices import DEVICES
import wideep_kernels.index_score as score
import wideep_kernels.indexer as indexer
from test_kernel_indexer import check_rows
from test_kernel_score_maxima import maxima_reference
from wideep_kernels.index_score_rows import prompt_row_groups


def groups_of(row_seqs, rows, max_runs=None):
    return prompt_row_groups(row_seqs, 4, max_runs or len(row_seqs), rows=rows)


def prompt_case(device, runs, block_size, heads=4, dim=16, seed=0, decoding=()):
    """Rows of prompt chunks: runs [(sequence length so far, rows)], each run the last `rows`
    positions of its sequence (row r sees g_len = start + r + 1 positions). `decoding`: lengths
    of sequences with one row each, appended after the runs' sequences. Block tables scatter the
    sequences over one slab, junk past each one's blocks."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n, r) for n, r in runs] + [(n, 1) for n in decoding]
    max_blocks = max(-(-n // block_size) for n, _ in seqs) + 1
    slab = len(seqs) * max_blocks + 3
    perm = torch.randperm(slab, generator=g)
    seq_tables = perm[:len(seqs) * max_blocks].view(len(seqs), max_blocks).to(torch.int32)
    for b, (n, _) in enumerate(seqs):
        seq_tables[b, -(-n // block_size):] = 10**6
    row_seqs, lens = [], []
    for b, (n, rows) in enumerate(seqs):
        row_seqs += [b] * rows
        lens += list(range(n - rows + 1, n + 1))
    row_seqs = torch.tensor(row_seqs)
    total = len(lens)
    q = torch.randn(total, heads, dim, generator=g)
    w = torch.randn(total, heads, generator=g)
    keys = torch.randn(slab * block_size, dim, generator=g)
    out = [q, w, keys, seq_tables[row_seqs], torch.tensor(lens, dtype=torch.int32)]
    return [t.to(device) for t in out], row_seqs.to(device)


CASES = [
    # one prompt chunk; rows_per_program 4: several groups, the last one short
    ([(90, 30)], (), 16),
    # two chunks and two decoding sequences: groups holding runs of two and three sequences
    ([(70, 6), (45, 9)], (33, 64), 8),
    # a decoding row first, then a chunk whose first rows see no position yet
    ([(5, 5)], (50,), 4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("runs,decoding,block_size", CASES)
@pytest.mark.parametrize("rows_per_program", [4, 8])
def test_grouped_scores_match_the_reference(device, runs, decoding, block_size, rows_per_program, monkeypatch):
    (q, w, keys, tables, lens), row_seqs = prompt_case(device, runs, block_size, decoding=decoding)
    want = indexer.indexer_scores_reference(q, w, keys, tables, lens, block_size, w_scale=0.5)
    # row by row, the launch's other form, agrees
    torch.testing.assert_close(score._score_launch(q, w, keys, tables, lens, block_size, w_scale=0.5), want,
                               rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(score, "_score_tile_kernel", None)  # the grouped launch alone may run
    got = score._score_launch(q, w, keys, tables, lens, block_size, w_scale=0.5,
                              row_groups=groups_of(row_seqs, rows_per_program))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_in_any_order_are_scored(device):
    """Sequences whose rows are not consecutive (not what the engine sends) cost more runs, not
    wrong scores."""
    (q, w, keys, tables, lens), row_seqs = prompt_case(device, [(40, 5), (60, 7)], 8, decoding=(20,))
    perm = torch.randperm(len(lens), generator=torch.Generator().manual_seed(3)).to(device)
    q, w, tables, lens, row_seqs = q[perm], w[perm], tables[perm], lens[perm], row_seqs[perm]
    want = indexer.indexer_scores_reference(q, w, keys, tables, lens, 8)
    got = score._score_launch(q, w, keys, tables, lens, 8, row_groups=groups_of(row_seqs, 4))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_zeroed_dead_tiles_and_maxima(device, monkeypatch):
    (q, w, keys, tables, lens), row_seqs = prompt_case(device, [(200, 20), (90, 3)], 16, decoding=(150,))
    monkeypatch.setattr(score, "ROWS_TILE", 32)
    groups = groups_of(row_seqs, 8, max_runs=3)
    want = indexer.indexer_scores_reference(q, w, keys, tables, lens, 16)
    zero = torch.full((len(lens), 7), 5, dtype=torch.int32, device=device)
    stride = 64
    m = torch.full((len(lens), stride), float("nan"), device=device)
    got = score._score_launch(q, w, keys, tables, lens, 16, zero=zero, maxima=m, row_groups=groups)
    assert not zero.any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m, maxima_reference(got, stride))
    # dead tiles skipped: positions below each row's length are the same, the rest unwritten
    got = score._score_launch(q, w, keys, tables, lens, 16, skip_dead=True, row_groups=groups)
    for row, n in enumerate(lens.tolist()):
        torch.testing.assert_close(got[row, :n], want[row, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_keys(device):
    """FP8 keys with their scales; on CUDA with a bf16 query they are scored in fp16, each row's
    query scaled by its own power of two."""
    (q, w, keys, tables, lens), row_seqs = prompt_case(device, [(120, 24)], 16, decoding=(70,))
    q = q * torch.logspace(-2, 3, q.shape[0], device=device)[:, None, None]  # rows of very different sizes
    keys8 = keys.to(torch.float8_e4m3fn)
    scale = torch.rand(keys.shape[0], device=device) + 0.5
    if device == "cuda":
        q, w = q.bfloat16(), w.bfloat16()
    want = indexer.indexer_scores_reference(q, w, keys8, tables, lens, 16, key_scale=scale)
    got = score._score_launch(q, w, keys8, tables, lens, 16, key_scale=scale, row_groups=groups_of(row_seqs, 8))
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3 * float(want[want.isfinite()].abs().max()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("runs,topk", [([(300, 40)], 24), ([(60, 20), (45, 10)], 16)])
def test_topk_with_row_groups_matches_reference(device, runs, topk):
    (q, w, keys, tables, lens), row_seqs = prompt_case(device, runs, 16, decoding=(90,))
    want = indexer.indexer_topk_reference(q, w, keys, tables, lens, 16, topk)
    got = indexer.indexer_topk_triton(q, w, keys, tables, lens, 16, topk, row_groups=groups_of(row_seqs, 8))
    check_rows(got, want, lens.tolist(), topk)


def test_row_groups():
    """Runs of one sequence cut into groups of at most `rows`, spare groups empty at the end."""
    seqs = torch.tensor([0] * 10 + [1] + [2] * 3 + [3])
    g = prompt_row_groups(seqs, 8, max_runs=4, rows=4)
    assert g.rows == 4 and g.first.shape[0] == -(-15 // 4) + 4
    live = g.count > 0
    assert g.first[live].tolist() == [0, 4, 8, 10, 11, 14]
    assert g.count[live].tolist() == [4, 4, 2, 1, 3, 1]
    assert not live[int(live.sum()):].any()  # the empty ones last
    # 64 heads: two rows a group; 2 heads of a tiny model: 8 rows, the MMA's 16 columns
    assert prompt_row_groups(seqs, 64, 4).rows == 2
    assert prompt_row_groups(seqs, 2, 4, rows=2).rows == 8
    assert prompt_row_groups(seqs, 128, 4) is None


def test_rows_per_group():
    from wideep_kernels.index_score_rows import rows_per_group
    assert rows_per_group(8) == 16      # the bench model's indexer: 16 rows x 8 heads a program
    assert rows_per_group(5) == 16      # heads padded to a power of two
    assert rows_per_group(64) == 2      # DeepSeek-V3.2's 64 heads: two rows a program
    assert rows_per_group(128) == 0     # the heads alone fill the MMA: row by row
