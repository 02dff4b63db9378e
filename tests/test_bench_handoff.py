"""bench.handoff_overlap on CPU: a smoke run of both modes."""
import json

from bench import handoff_overlap


def test_smoke_both_modes_keep_stepping_ahead(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    handoff_overlap.main(["--preset", "tiny", "--device", "cpu", "--batches", "2", "--steps", "3", "--rounds", "1",
                          "--prompt", "24", "--out", str(out)])
    report = json.loads(out.read_text())
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"withhold", "wait"}
    for row in rows.values():
        for ms in (row["base_ms"], row["handoff_ms"]):
            assert 0 < ms["min"] <= ms["median"] <= ms["max"]
        # every step of a decoding batch is launched ahead, hand-offs between them or not
        assert row["handoff_steps_ahead"] == row["handoff_steps"] == 3
