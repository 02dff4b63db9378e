"""bench.ep_decode on CPU: a smoke run of the plain engine and a one-rank expert-parallel group
(gloo), with the start and first-steps figures the warm-up comparison reads."""
import json

import torch.distributed as dist

from bench import ep_decode


def test_smoke_plain_and_one_rank_group(tmp_path):
    out = tmp_path / "rows.jsonl"
    ep_decode.main(["--preset", "tiny", "--device", "cpu", "--batches", "2", "--steps", "3", "--prompt", "16",
                    "--modes", "plain", "ep", "--warmup", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("plain", 2), ("ep", 2)]
    for r in rows:
        assert r["start_s"] >= 0 and r["first_6_steps_s"] > 0 and 0 < r["p50_ms"] <= r["max_ms"]
        assert r["tok_s"] > 0
    assert not dist.is_initialized()  # the bench's group is gone
