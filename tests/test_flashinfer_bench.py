"""bench/flashinfer_mla.py hands FlashInfer the keys our kernel reads (checked on CPU; the
timing itself needs a GPU and FlashInfer)."""
import torch

from bench.flashinfer_mla import (BLOCK, KV_LORA, flashinfer_indices, gathered_attention, make_case, make_ring,
                                  window_indices)
from wideep_kernels.mla_decode import mla_decode_reference


def test_one_slot_pages_select_the_topk_keys():
    q_lat, q_rope, kv, tables, lens, topk_pos = make_case(batch=3, heads=2, context=200, topk=16, device="cpu")
    indptr, indices = flashinfer_indices(tables, topk_pos)
    assert indptr.tolist() == [0, 16, 32, 48] and indices.dtype == torch.int32
    assert len(set(indices.tolist())) == 48  # distinct slots: no two sequences share a block
    scale = 0.07
    ref = mla_decode_reference(torch.cat([q_lat, q_rope], -1).float(), kv.float(), None, tables, lens, BLOCK, scale,
                               KV_LORA, topk_pos=topk_pos)
    got = gathered_attention(q_lat, q_rope, kv, indptr, indices, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # Another choice of keys gives another result: the comparison can fail.
    other = gathered_attention(q_lat, q_rope, kv, indptr, indices.roll(1), scale)
    assert (other - ref).abs().max() > 1e-2


def test_window_path_reads_the_keys_the_step_reads():
    """--window: the top-k slots plus the ring rows after the ring write are the keys of the
    reference's ring read (fresh latent in, the entry it replaces out)."""
    q_lat, q_rope, kv, tables, lens, topk_pos = make_case(batch=3, heads=2, context=200, topk=16, device="cpu")
    window = 8
    ring_kv, slots, fresh, write_idx, win_valid = make_ring(3, window, "cpu")
    scale = 0.07
    ref = mla_decode_reference(torch.cat([q_lat, q_rope], -1).float(), kv.float(), None, tables, lens, BLOCK, scale,
                               KV_LORA, topk_pos=topk_pos, win_valid=win_valid,
                               ring=(ring_kv.clone().float(), slots, fresh.float(), write_idx))
    rows = ring_kv.view(-1, kv.shape[1]).clone()
    rows.index_copy_(0, slots * window + write_idx, fresh)
    indptr, indices = flashinfer_indices(tables, topk_pos)
    win = window_indices(slots, window).view(3, window) + kv.shape[0]
    union = torch.cat([indices.view(3, -1), win], dim=1)
    union_ptr = torch.arange(4, dtype=torch.int32) * union.shape[1]
    got = gathered_attention(q_lat, q_rope, torch.cat([kv, rows]), union_ptr, union.flatten(), scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # the ring before its write holds the replaced entry instead of the fresh latent: another result
    stale = gathered_attention(q_lat, q_rope, torch.cat([kv, ring_kv.view(-1, kv.shape[1])]), union_ptr,
                               union.flatten(), scale)
    assert (stale - ref).abs().max() > 1e-3
