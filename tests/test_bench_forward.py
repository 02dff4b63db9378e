"""bench.forward on CPU: the roofline's byte count with index sharing, and a smoke run."""
import json

import torch

from bench import forward
from bench.engine_vs_hf import build_ours
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine


def test_roofline_bytes_leave_out_what_reusing_layers_do_not_read():
    cfg = preset("tiny-v4")  # 4 layers, window 8, index_topk 16, 2 x 16-wide index keys
    model = build_ours(cfg, "cpu", torch.float32)
    batch, context = 2, 64

    def step_bytes(freq):
        ecfg = EngineConfig(block_size=16, num_blocks=batch * 5 + 1, max_num_seqs=batch, index_topk_freq=freq)
        return forward.step_bytes(LLMEngine(model, None, ecfg), batch, context, [0] * 3)

    every, half = step_bytes(1), step_bytes(2)
    g_len = context + 1 - (cfg.sliding_window - 1)  # global positions past the window: > index_topk
    keys = batch * g_len * cfg.index_head_dim * 4  # one layer's index-key read, fp32
    attn = model.model.layers[1].self_attn
    weights = (attn.indexer.wq.weight.numel() + attn.indexer.weights_proj.weight.numel()) * 4
    assert every - half == 2 * (keys + weights)  # layers 1 and 3 neither read keys nor project queries


def test_smoke_rows_per_sharing_choice(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    rows = forward.main(["--device", "cpu", "--preset", "tiny-v4", "--batch", "2", "--contexts", "64",
                         "--iters", "2", "--index-topk-freq", "1", "2", "--json", str(out)])
    assert [r["index_topk_freq"] for r in rows] == [1, 2]
    assert all(r["forward_ms"] > 0 and r["bytes_per_step_gb"] >= 0 for r in rows)
    assert [json.loads(line)["index_topk_freq"] for line in out.read_text().splitlines()] == [1, 2]


def test_profile_turns_dependent_launches_off_for_its_step_only(tmp_path, monkeypatch):
    from wideep_kernels import pdl
    from engine.model_runner import ModelRunner
    monkeypatch.setattr(pdl, "MODE", pdl.MODES["early"])
    modes, real = [], ModelRunner.decode_forward
    monkeypatch.setattr(ModelRunner, "decode_forward", lambda self, *a: modes.append(pdl.MODE) or real(self, *a))
    path = tmp_path / "profile.txt"
    rows = forward.main(["--device", "cpu", "--preset", "tiny-v4", "--batch", "2", "--contexts", "64",
                         "--iters", "2", "--profile", str(path)])
    head = path.read_text().splitlines()[0]
    assert head.startswith("## batch 2, context 64") and "dependent launches off" in head, head
    assert rows[0]["kernels_per_step"] == 0  # no CUDA kernels on CPU; the table is of CPU ops
    assert pdl.MODE == pdl.MODES["early"]
    # the timed steps ran as configured, the profiled step (and its warm-up) without
    assert modes[-2:] == [0, 0] and set(modes[:-2]) == {pdl.MODES["early"]}, modes
