"""bench.plot_forward: bench.forward's rows as a PNG and a table of growth over the shortest context."""
import json

import pytest

from bench import plot_forward


def _row(batch, context, ms, roof=None, **kw):
    return dict(preset="bench", batch=batch, context=context, forward_ms=ms,
                **({} if roof is None else {"roofline_ms": roof}), **kw)


def test_png_and_table_from_forward_rows(tmp_path, capsys):
    log = tmp_path / "forward.log"
    rows = [_row(1, 8192, 1.0, 0.4), _row(1, 524288, 1.3, 0.5), _row(1, 131072, 1.1, 0.45),
            _row(16, 8192, 3.0, index_dtype="float8_e4m3fn"), _row(16, 524288, 6.0, index_dtype="float8_e4m3fn")]
    # a log: other lines, and the closing report line, which holds the rows again
    log.write_text("building...\n" + "\n".join(json.dumps(r) for r in rows) + "\n"
                   + json.dumps({"preset": "bench", "rows": rows}) + "\n{not json\n")
    out = tmp_path / "plot.png"
    plot_forward.main([str(log), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    lines = [line for line in text.splitlines() if line.startswith("| batch")]
    assert lines == [
        "| batch 1 | 8,192 | 1.000 | +0.0% | 0.400 | 40.0% |",
        "| batch 1 | 131,072 | 1.100 | +10.0% | 0.450 | 40.9% |",
        "| batch 1 | 524,288 | 1.300 | +30.0% | 0.500 | 38.5% |",
        "| batch 16, index float8_e4m3fn | 8,192 | 3.000 | +0.0% | - | - |",
        "| batch 16, index float8_e4m3fn | 524,288 | 6.000 | +100.0% | - | - |",
    ]


def test_a_file_without_rows_is_refused(tmp_path):
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit, match="no bench.forward rows"):
        plot_forward.main([str(empty), "--out", str(tmp_path / "x.png")])
