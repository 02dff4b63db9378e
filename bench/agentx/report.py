"""AgentX metrics from per-request records, JSON summaries and PNG plots.

    throughput per GPU = (cached input + uncached input + output tokens) / wall time / GPUs
    per-user speed     = 1 / P90 over requests of (end-to-end latency / output tokens)

Percentiles interpolate linearly between order statistics (numpy's default), so P90 of
1..10 is 9.1. Only successful requests enter latency figures; every request's tokens count
for throughput only if it succeeded (a failed request produced nothing usable).

Prefix reuse: the theoretical reusable prefix of a request is the number of tokens its prompt
shares with the same session's previous prompt, rounded down to the KV block size (only whole
blocks can be cached). First turns have none by definition, so tokens a first turn finds in
the cache (a system prompt shared across sessions) are reported apart.

TTFT and ITL are stamped when a streamed chunk carries text. A request whose text chunks are
fewer than its output tokens (tokens that decode to no text, or several tokens in one chunk)
has a late or missing TTFT and ITL samples that are gaps between chunks, not tokens: the
summary counts them (`short_stream_requests`, `itl_samples` against `itl_expected`) and the
table flags such levels with `*`.

A run directory holds records.jsonl (one line per request, with its concurrency) and
summary.json (the run's meta, each level's wall time and the figures below); the plots are
re-rendered from those two.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def pct(values, q: float) -> float | None:
    """q in [0, 100]; None for no values."""
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def theoretical_reuse(shared_prefix_tokens: int | None, kv_block_size: int) -> int | None:
    if shared_prefix_tokens is None:
        return None
    return (shared_prefix_tokens // kv_block_size) * kv_block_size


def text_chunks(r: dict) -> int:
    """Text chunks a request received (records written before the field existed: one per
    ITL sample plus the first, when there was a first)."""
    if r.get("text_chunks") is not None:
        return r["text_chunks"]
    return len(r["itl_s"]) + 1 if r.get("ttft_s") is not None else 0


def level_metrics(records: list[dict], wall_s: float, gpus: float, kv_block_size: int) -> dict:
    ok = [r for r in records if r["ok"]]
    cached = sum(r["cached_tokens"] for r in ok)
    uncached = sum(r["uncached_tokens"] for r in ok)
    output = sum(r["output_tokens"] for r in ok)
    per_token = [r["e2e_s"] / r["output_tokens"] for r in ok if r["output_tokens"] > 0]
    p90_per_token = pct(per_token, 90)
    itl = [x for r in ok for x in r["itl_s"]]
    ms = lambda v: None if v is None else round(1000 * v, 2)  # noqa: E731

    producing = [r for r in ok if r["output_tokens"] > 0]
    short = [r for r in producing if text_chunks(r) < r["output_tokens"]]

    later = [r for r in ok if r["turn"] > 0 and r.get("shared_prefix_tokens") is not None]
    theo = [theoretical_reuse(r["shared_prefix_tokens"], kv_block_size) for r in later]
    hit = [r["cached_tokens"] for r in later]
    theo_sum = sum(theo)
    return {
        "requests": len(records), "failed": len(records) - len(ok), "wall_s": round(wall_s, 3),
        "input_cached_tokens": cached, "input_uncached_tokens": uncached, "output_tokens": output,
        "throughput_per_gpu": round((cached + uncached + output) / wall_s / gpus, 2) if wall_s > 0 else None,
        "per_user_tok_s": round(1 / p90_per_token, 3) if p90_per_token else None,
        "ttft_p50_ms": ms(pct([r["ttft_s"] for r in ok], 50)), "ttft_p90_ms": ms(pct([r["ttft_s"] for r in ok], 90)),
        "itl_p50_ms": ms(pct(itl, 50)), "itl_p90_ms": ms(pct(itl, 90)),
        # how complete the latency figures are: requests with fewer text chunks than output
        # tokens, requests with no text at all (no TTFT), and ITL samples against tokens - 1
        "text_chunks": sum(text_chunks(r) for r in ok),
        "short_stream_requests": len(short), "ttft_missing": sum(1 for r in producing if r["ttft_s"] is None),
        "itl_samples": len(itl), "itl_expected": sum(r["output_tokens"] - 1 for r in producing),
        "e2e_p50_s": _round(pct([r["e2e_s"] for r in ok], 50), 3),
        "prefix_hit_tokens": sum(hit), "theoretical_reuse_tokens": theo_sum,
        # cached tokens on later turns over what the previous turn made reusable; can pass 1
        # when a prompt also hits blocks another session left (the shared system prompt)
        "prefix_hit_ratio": round(sum(hit) / theo_sum, 4) if theo_sum else None,
        # the same with each request's hits capped at its own theoretical reuse
        "prefix_hit_ratio_capped": round(sum(min(h, t) for h, t in zip(hit, theo)) / theo_sum, 4)
        if theo_sum else None,
        "first_turn_cached_tokens": sum(r["cached_tokens"] for r in ok if r["turn"] == 0),
    }


def _round(v, n):
    return None if v is None else round(v, n)


def summarise(levels: list[dict], meta: dict) -> dict:
    """levels: [{concurrency, wall_s, records}] -> the summary.json object."""
    gpus, block = meta.get("gpus", 1), meta.get("kv_block_size", 16)
    if gpus <= 0 or block <= 0:
        raise ValueError(f"gpus and kv_block_size must be positive, got {gpus}, {block}")
    rows = [{"concurrency": lv["concurrency"], **level_metrics(lv["records"], lv["wall_s"], gpus, block)}
            for lv in levels]
    return {"meta": meta, "levels": sorted(rows, key=lambda r: r["concurrency"])}


def write_run(out: Path, levels: list[dict], meta: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "records.jsonl").open("w") as f:
        for lv in levels:
            for r in lv["records"]:
                f.write(json.dumps({"concurrency": lv["concurrency"], **_compact(r)}, separators=(",", ":")) + "\n")
    summary = summarise(levels, meta)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_run(out, summary, levels)
    return summary


def _compact(r: dict) -> dict:
    """Times in ms with 0.1 ms resolution keep records.jsonl small."""
    r = dict(r)
    r["itl_ms"] = [round(1000 * x, 1) for x in r.pop("itl_s")]
    for k in ("e2e_s", "ttft_s", "sent_s"):
        if r.get(k) is not None:
            r[k] = round(r[k], 5)
    return r


def load_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(levels with records, meta) from a run directory."""
    summary_path, records_path = run_dir / "summary.json", run_dir / "records.jsonl"
    for p in (summary_path, records_path):
        if not p.exists():
            raise FileNotFoundError(f"{p} is missing: is {run_dir} the --out directory of a run?")
    summary = json.loads(summary_path.read_text())
    by: dict[int, list[dict]] = {}
    for i, line in enumerate(records_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        r = json.loads(line)
        r["itl_s"] = [x / 1000 for x in r.pop("itl_ms", [])]
        by.setdefault(r["concurrency"], []).append(r)
    walls = {lv["concurrency"]: lv["wall_s"] for lv in summary["levels"]}
    levels = [{"concurrency": c, "wall_s": walls[c], "records": rs} for c, rs in sorted(by.items())]
    return levels, summary["meta"]


def rerender(run_dir: Path, **meta_overrides) -> dict:
    levels, meta = load_run(run_dir)
    meta.update({k: v for k, v in meta_overrides.items() if v is not None})
    return write_run(run_dir, levels, meta)


# plots ------------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")  # no display where benchmarks run
    import matplotlib.pyplot as plt
    return plt


def plot_run(out: Path, summary: dict, levels: list[dict]) -> None:
    plot_tradeoff(out / "throughput_vs_speed.png", {summary["meta"].get("label", out.name): summary})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=80)
    for lv in levels:
        ttft = sorted(1000 * r["ttft_s"] for r in lv["records"] if r["ok"] and r["ttft_s"] is not None)
        if ttft:
            ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=f"concurrency {lv['concurrency']}")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT distribution: {summary['meta'].get('label', out.name)}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png")
    plt.close(fig)


def plot_tradeoff(path: Path, runs: dict[str, dict]) -> None:
    """Throughput per GPU against per-user speed, one line per run, points labelled by concurrency."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=80)
    for label, summary in runs.items():
        pts = [(lv["per_user_tok_s"], lv["throughput_per_gpu"], lv["concurrency"]) for lv in summary["levels"]
               if lv["per_user_tok_s"] and lv["throughput_per_gpu"]]
        if not pts:
            continue
        xs, ys, cs = zip(*pts)
        ax.plot(xs, ys, marker="o", label=label)
        for x, y, c in pts:
            ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("per-user speed (output tok/s, 1 / P90 latency per token)")
    ax.set_ylabel("throughput per GPU (tok/s)")
    ax.set_title("throughput vs per-user speed (labels: concurrency)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(runs: dict[str, dict]) -> str:
    """A markdown table of every run's levels."""
    head = ("| run | conc. | requests (failed) | wall s | tok/s/GPU | per-user tok/s | TTFT p50 / p90 ms "
            "| ITL p50 / p90 ms | ITL samples / tokens-1 | prefix hit / theoretical | ratio (capped) |")
    lines = [head, "|" + "---|" * 11]
    flagged = False
    for label, s in runs.items():
        for lv in s["levels"]:
            ratio = "-" if lv["prefix_hit_ratio"] is None else \
                f"{lv['prefix_hit_ratio']:.2f} ({lv['prefix_hit_ratio_capped']:.2f})"
            short = lv.get("short_stream_requests")  # absent in summaries written before it existed
            mark = " *" if short else ""
            flagged |= bool(short)
            samples = "-" if short is None else f"{lv['itl_samples']} / {lv['itl_expected']}"
            lines.append(
                f"| {label} | {lv['concurrency']} | {lv['requests']} ({lv['failed']}) | {lv['wall_s']:.1f} "
                f"| {_f(lv['throughput_per_gpu'], 0)} | {_f(lv['per_user_tok_s'], 1)} "
                f"| {_f(lv['ttft_p50_ms'], 0)} / {_f(lv['ttft_p90_ms'], 0)}{mark} "
                f"| {_f(lv['itl_p50_ms'], 0)} / {_f(lv['itl_p90_ms'], 0)}{mark} | {samples} "
                f"| {lv['prefix_hit_tokens']} / {lv['theoretical_reuse_tokens']} | {ratio} |")
    if flagged:
        lines.append("\n\\* some requests streamed fewer text chunks than output tokens (tokens that decode "
                     "to no text): their TTFT is late or missing and ITL is measured between text chunks, "
                     "not tokens; these figures are unreliable.")
    return "\n".join(lines)


def _f(v, n):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{n}f}"
