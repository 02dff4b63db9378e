"""bench.graph_widths on CPU: a smoke run of both parts (no graphs off the GPU: the plumbing)."""
import json

from bench import graph_widths
from engine.cuda_graphs import DecodeGraphs


def test_smoke_both_parts_every_mode(tmp_path):
    saved = DecodeGraphs._capture, DecodeGraphs._before_capture, DecodeGraphs._logits
    out = tmp_path / "rows.jsonl"
    graph_widths.main(["--preset", "tiny", "--device", "cpu", "--batches", "2", "--contexts", "40",
                       "--steps", "12", "--iters", "2", "--prompt", "24", "--turn-prompt", "40",
                       "--turn-steps", "6", "--turn-new", "8", "--out", str(out)])
    report = json.loads(out.read_text())
    cost = [r for r in report["rows"] if r["part"] == "cost"]
    serve = {r["mode"]: r for r in report["rows"] if r["part"] == "serve"}
    assert len(cost) == 1 and cost[0]["bucket_ms"] > 0 and cost[0]["shared_ms"] > 0
    assert set(serve) == set(graph_widths.MODES)
    for row in serve.values():
        assert row["steps"] >= 8 and 0 < row["median_ms"] <= row["max_ms"]
        assert row["captured_serving"] == 0 and row["capture_ms_each"] is None  # no graphs on CPU
        assert row["engine_mb"] == row["serving_added_mb"] == 0  # device memory: none on CPU
    turns = [(r["mode"], r["turn"]) for r in report["rows"] if r["part"] == "turns"]
    assert turns == [("no_ahead", 1), ("no_ahead", 2), ("ahead", 1), ("ahead", 2)]
    for row in report["rows"]:
        if row["part"] == "turns":
            assert row["turn_s"] > 0 and row["captures"] == 0 and row["context"] == 46 + (row["turn"] - 1) * 14
            assert row["turn"] == 1 or row["idle_captures"] == 0  # no graphs on CPU
    # the capture clock put DecodeGraphs back as it was
    assert (DecodeGraphs._capture, DecodeGraphs._before_capture, DecodeGraphs._logits) == saved
