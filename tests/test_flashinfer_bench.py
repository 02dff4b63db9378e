"""bench/flashinfer_mla.py hands FlashInfer the keys our kernel reads (checked on CPU; the
timing itself needs a GPU and FlashInfer)."""
import torch

from bench.flashinfer_mla import BLOCK, KV_LORA, flashinfer_indices, gathered_attention, make_case
from kernels.mla_decode import mla_decode_reference


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
