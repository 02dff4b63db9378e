"""Side-stream branches of the decode step (engine/streams.py) and the deferred shared-expert sum."""
import pytest
import torch

from engine.streams import Branch
from wideep_kernels.moe_gemm import fused_experts


def test_branch_runs_inline_outside_a_capture():
    calls = []

    def fn(a, b):
        calls.append((a, b))
        return a + b
    branch = Branch(True, fn, 2, 3)
    assert calls == [(2, 3)] and not branch.forked  # no capture here: ran at once, on this stream
    assert branch.join() == 5 and branch.join() == 5
    assert Branch(False, fn, 1, 1).join() == 2


@pytest.mark.parametrize("token_major", [True, False])
def test_fused_experts_takes_the_shared_output_late(token_major):
    g = torch.Generator().manual_seed(0)
    t, h, inter, slots, k = 5, 16, 8, 4, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(slots, 2 * inter, h, generator=g) / 4
    w2 = torch.randn(slots, h, inter, generator=g) / 4
    slot_of = torch.randint(0, slots, (t * k,), generator=g)
    weight_of = torch.rand(t * k, generator=g)
    token_of = None if token_major else torch.arange(t * k) // k
    shared = torch.randn(t, h, generator=g)
    calls = []

    def later():
        calls.append(1)
        return shared
    eager = fused_experts(x, w13, w2, token_of, slot_of, weight_of, add=shared)
    deferred = fused_experts(x, w13, w2, token_of, slot_of, weight_of, add=later)
    assert calls == [1]
    torch.testing.assert_close(deferred, eager)
    torch.testing.assert_close(eager, fused_experts(x, w13, w2, token_of, slot_of, weight_of) + shared)


def test_engine_config_names_the_overlap_switch():
    from engine.config import EngineConfig
    assert EngineConfig().decode_overlap is True
    assert EngineConfig(decode_overlap=False).decode_overlap is False
