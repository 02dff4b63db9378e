"""Decode step time against context, from bench.forward's JSON rows: a PNG and a table.

    python3 -m bench.plot_forward bench/results/<run>/forward.jsonl --out forward_context.png

Reads every JSON line with a `context` and a `forward_ms` (the per-row lines bench.forward
prints, its `--json` output, or logs holding them; its closing report line is skipped) from the
given files. One series per batch size and KV/index/expert dtypes: the forward time (graph
replay) by context on a log scale, beside it the step's HBM roofline (`roofline_ms`: the bytes
a step must read at the copy bandwidth measured in the same run), and the band of +10% over the
series' shortest context, the issue's target for the growth from 8K to 512K. The table gives
each point's growth over that shortest context and its share of the roofline.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "context" in row and "forward_ms" in row:
                rows.append(row)
    return rows


def series_key(row: dict) -> tuple:
    return (row.get("batch"), row.get("kv_dtype", "auto"), row.get("index_dtype", "bfloat16"),
            row.get("expert_dtype", "auto"))


def label(key: tuple) -> str:
    batch, kv, index, experts = key
    parts = [f"batch {batch}"]
    parts += [f"{name} {value}" for name, value in (("KV", kv), ("index", index), ("experts", experts))
              if value not in ("auto", "bfloat16")]
    return ", ".join(parts)


def group(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by series, each sorted by context; a context measured twice keeps its last row."""
    out: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        out.setdefault(series_key(row), {})[row["context"]] = row
    return {key: [by_ctx[c] for c in sorted(by_ctx)] for key, by_ctx in sorted(out.items(), key=lambda kv: str(kv[0]))}


def table(series: dict[tuple, list[dict]]) -> str:
    lines = ["| series | context | forward ms | vs shortest | roofline ms | of roofline |",
             "|---|---|---|---|---|---|"]
    for key, rows in series.items():
        base = rows[0]["forward_ms"]
        for row in rows:
            ms, roof = row["forward_ms"], row.get("roofline_ms")
            roof_ms = "-" if roof is None else f"{roof:.3f}"
            share = "-" if roof is None else f"{100 * roof / ms:.1f}%"
            lines.append(f"| {label(key)} | {row['context']:,} | {ms:.3f} | {100 * (ms / base - 1):+.1f}% | "
                         f"{roof_ms} | {share} |")
    return "\n".join(lines)


def plot(series: dict[tuple, list[dict]], out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (key, rows) in enumerate(series.items()):
        color = f"C{i}"
        ctx = [r["context"] for r in rows]
        ms = [r["forward_ms"] for r in rows]
        ax.plot(ctx, ms, "o-", color=color, label=label(key))
        roof = [r.get("roofline_ms") for r in rows]
        if all(v is not None for v in roof):
            ax.plot(ctx, roof, ":", color=color, label=f"{label(key)}: HBM roofline")
        ax.fill_between([ctx[0], ctx[-1]], ms[0], 1.1 * ms[0], color=color, alpha=0.12, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["context"] for rows in series.values() for r in rows}))
    ax.set_xticklabels([f"{c // 1024}K" if c >= 1024 else str(c)
                        for c in sorted({r["context"] for rows in series.values() for r in rows})])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, forward (ms)")
    ax.set_title(title + "\n(shaded: within +10% of the shortest context)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="files holding bench.forward's JSON rows")
    ap.add_argument("--out", default="forward_context.png", help="the PNG to write")
    ap.add_argument("--title", default="Decode step against context")
    args = ap.parse_args(argv)
    series = group(read_rows(args.paths))
    if not series:
        raise SystemExit(f"no bench.forward rows (context, forward_ms) in {', '.join(args.paths)}")
    plot(series, args.out, args.title)
    print(table(series))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
