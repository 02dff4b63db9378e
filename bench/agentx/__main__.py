"""AgentX-style benchmark: multi-turn agent sessions replayed closed-loop over HTTP.

    python -m bench.agentx gen --out traces.jsonl [--sessions 8 --seed 0 ...]
    python -m bench.agentx run --config config.yaml --concurrency 1 2 4 --sessions 8 --out DIR
    python -m bench.agentx run --url http://127.0.0.1:8000 --trace traces.jsonl --out DIR
    python -m bench.agentx report DIR [DIR ...]

`run` without --url starts the Serve application of --config (a `serve run` config file,
or a YAML mapping of build_app args) on a local Ray of its own, drives it, and shuts it
down; --override merges YAML into those args (e.g. --override '{kv_transport: {backend: none}}').
Without --trace it generates a workload from the gen options (prompt lengths counted by the
model's own tokenizer). Each concurrency level replays --sessions sessions and writes into
--out: records.jsonl, summary.json, throughput_vs_speed.png, ttft_cdf.png.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import client, report
from .traces import to_agentx_json
from .workload import WorkloadSpec, generate, read_trace, sessions_of, write_trace


def _workload_args(ap: argparse.ArgumentParser) -> None:
    d = WorkloadSpec()
    g = ap.add_argument_group("workload (when generated)")
    g.add_argument("--trace-sessions", type=int, default=d.sessions, help="distinct sessions in the trace")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--turns", type=int, nargs=2, default=[d.min_turns, d.max_turns], metavar=("MIN", "MAX"))
    g.add_argument("--system-tokens", type=int, default=d.system_tokens)
    g.add_argument("--task-tokens", type=int, default=d.task_tokens)
    g.add_argument("--answer-tokens", type=int, nargs=2, default=list(d.answer_tokens), metavar=("LO", "HI"))
    g.add_argument("--tool-tokens", type=int, nargs=2, default=list(d.tool_tokens), metavar=("LO", "HI"))
    g.add_argument("--large-tool-tokens", type=int, nargs=2, default=list(d.large_tool_tokens), metavar=("LO", "HI"))
    g.add_argument("--large-tool-prob", type=float, default=d.large_tool_prob)
    g.add_argument("--think-mean", type=float, default=d.think_time_mean_s, help="mean think time (s)")
    g.add_argument("--max-context", type=int, default=None,
                   help=f"session length cap in tokens (default: the served context less 5%%, or {d.max_context_tokens})")
    g.add_argument("--api", choices=["chat", "completions"], default=d.api,
                   help="chat: text messages; completions: hash ids replayed as token ids")
    g.add_argument("--block-tokens", type=int, default=d.block_tokens, help="tokens per hash block (completions)")


def _spec(a, max_context: int) -> WorkloadSpec:
    return WorkloadSpec(
        sessions=a.trace_sessions, seed=a.seed, min_turns=a.turns[0], max_turns=a.turns[1],
        system_tokens=a.system_tokens, task_tokens=a.task_tokens, answer_tokens=tuple(a.answer_tokens),
        tool_tokens=tuple(a.tool_tokens), large_tool_tokens=tuple(a.large_tool_tokens),
        large_tool_prob=a.large_tool_prob, think_time_mean_s=a.think_mean, max_context_tokens=max_context,
        api=a.api, block_tokens=a.block_tokens)


def _counter(model_dir: str | None):
    if not model_dir:
        return None
    from engine.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    return lambda msgs: len(tok.apply_chat_template(msgs))


def cmd_gen(a) -> None:
    spec = _spec(a, a.max_context or WorkloadSpec().max_context_tokens)
    reqs = generate(spec, _counter(a.tokenizer))
    if a.format == "agentx":
        if spec.api != "completions":
            raise SystemExit("--format agentx needs --api completions (the AgentX form has no text)")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("".join(json.dumps(to_agentx_json(r)) + "\n" for r in reqs))
    else:
        write_trace(a.out, reqs)
    print(f"wrote {len(reqs)} requests of {len(sessions_of(reqs))} sessions to {a.out}")


# the served application ---------------------------------------------------------------------

def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def app_args(config: str | None, overrides: list[str], model_path: str | None) -> dict:
    import yaml
    args: dict = {}
    if config:
        doc = yaml.safe_load(Path(config).read_text()) or {}
        args = doc["applications"][0].get("args", {}) if "applications" in doc else doc
    for text in overrides:
        extra = yaml.safe_load(text)
        if not isinstance(extra, dict):
            raise SystemExit(f"--override must be a YAML mapping, got {text!r}")
        args = _merge(args, extra)
    if model_path:
        args = _merge(args, {"model": {"path": model_path}})
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base_url: str, model: str, limit_s: float = 300) -> None:
    import httpx2
    deadline, last = time.monotonic() + limit_s, None
    while time.monotonic() < deadline:
        try:
            r = httpx2.post(f"{base_url}/v1/completions", timeout=120,
                            json={"model": model, "prompt": [20, 21, 22], "max_tokens": 1})
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx2.HTTPError as e:
            last = repr(e)
        time.sleep(1)
    raise RuntimeError(f"the application did not answer within {limit_s:.0f} s ({last})")


class LocalServe:
    """The Serve application on a local Ray with its own temp dir; shut down on exit. The temp dir
    (Ray's session and the workers' logs) is removed after a clean run and kept, its path printed,
    after a failure."""

    def __init__(self, args: dict, num_cpus: int | None = None, ray_logs: bool = False):
        self.args, self.num_cpus, self.ray_logs = args, num_cpus or os.cpu_count(), ray_logs

    def __enter__(self):
        import ray
        from ray import serve

        from app.main import build_app
        port = _free_port()
        # Short, under /tmp: Ray's socket paths inside it must fit a Unix socket name.
        self.temp_dir = tempfile.mkdtemp(prefix="agentx-ray-")
        # worker logs would scroll the progress bar away; they stay in the temp dir's logs
        ray.init(num_cpus=self.num_cpus, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=self.ray_logs, _temp_dir=self.temp_dir,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(self.args), name="wideep", route_prefix="/", blocking=False)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        self.url = f"http://127.0.0.1:{port}"
        return self

    def decode_stats(self) -> list[dict] | None:
        from ray import serve
        try:
            return serve.get_deployment_handle("DecodeGroup", app_name="wideep").stats.remote().result()
        except Exception:  # stats are a bonus; the benchmark's figures come from the client
            return None

    def __exit__(self, exc_type=None, *exc):
        import ray
        from ray import serve
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if exc_type is None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
            else:
                print(f"Ray's logs of this run: {self.temp_dir}/session_latest/logs", file=sys.stderr)


def _model_facts(args: dict) -> dict:
    """Model dir, vocabulary, context and KV block size of the app `args` would serve."""
    from app.config import parse_app_config
    from app.main import resolve_model
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import context_limit
    cfg = parse_app_config(args)
    path = str(resolve_model(cfg))
    mc = ModelConfig.from_file(path)
    ec = EngineConfig(**cfg.engine.model_dump(exclude={"device"}))
    return {"model_dir": path, "vocab_size": mc.vocab_size, "context": context_limit(mc, ec),
            "kv_block_size": ec.block_size, "name": cfg.model.served_name}


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cmd_run(a) -> None:
    facts = {} if a.url else _model_facts(app_args(a.config, a.override, a.model_path))
    model_dir = facts.get("model_dir") or a.tokenizer
    vocab = a.vocab_size or facts.get("vocab_size")
    block = a.kv_block_size or facts.get("kv_block_size") or 16
    max_context = a.max_context or (int(facts["context"] * 0.95) if facts else WorkloadSpec().max_context_tokens)
    if a.trace:
        reqs = read_trace(a.trace, trace_block_size=a.trace_block_size, replay_block_tokens=a.replay_block_tokens,
                          max_context_tokens=max_context)
    else:
        reqs = generate(_spec(a, max_context), _counter(model_dir))
    sessions = sessions_of(reqs)
    meta = {"label": a.label or Path(a.out).name, "command": shlex.join(["python", "-m", "bench.agentx", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(), "machine": f"{os.cpu_count()}-core {platform.machine()} CPU host",
            "gpus": a.gpus, "kv_block_size": block, "sessions_per_level": a.sessions,
            "trace": {"source": a.trace or "generated", "sessions": len(sessions), "requests": len(reqs),
                      "mean_input_tokens": round(sum(r.input_tokens for r in reqs) / len(reqs), 1),
                      "mean_max_tokens": round(sum(r.max_tokens for r in reqs) / len(reqs), 1)},
            "server": a.url or {"config": a.config, "overrides": a.override}}
    levels = []

    def sweep(url: str, model: str):
        for c in a.concurrency:
            lv = asyncio.run(client.run_level(url, sessions, c, a.sessions, model=model, vocab_size=vocab,
                                              think_scale=a.think_scale, progress=not a.quiet))
            levels.append(lv)

    if a.url:
        sweep(a.url.rstrip("/"), a.model or asyncio.run(client.served_model(a.url.rstrip("/"))))
    else:
        with LocalServe(app_args(a.config, a.override, a.model_path), a.num_cpus, a.ray_logs) as srv:
            t0 = time.perf_counter()
            _wait_ready(srv.url, facts["name"])
            meta["warmup_s"] = round(time.perf_counter() - t0, 1)
            sweep(srv.url, facts["name"])
            stats = srv.decode_stats()
            if stats:
                meta["decode_stats"] = {k: sum(s.get(k, 0) for s in stats) for k in
                                        ("prefill_remote", "kv_bytes_received", "prefix_hit_tokens")
                                        if any(k in s for s in stats)}
    summary = report.write_run(Path(a.out), levels, meta)
    print(report.table({meta["label"]: summary}))


def cmd_report(a) -> None:
    runs = {}
    for d in a.dirs:
        s = report.rerender(Path(d), gpus=a.gpus, kv_block_size=a.kv_block_size)
        runs[s["meta"].get("label", Path(d).name)] = s
    if len(runs) > 1:
        out = Path(a.out) if a.out else Path(a.dirs[0]).resolve().parent / "throughput_vs_speed.png"
        report.plot_tradeoff(out, runs)
        print(f"wrote {out}")
    print(report.table(runs))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.agentx", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("gen", help="write a synthetic trace")
    g.add_argument("--out", required=True)
    g.add_argument("--format", choices=["ours", "agentx"], default="ours")
    g.add_argument("--tokenizer", help="checkpoint dir whose tokenizer counts chat prompts exactly")
    _workload_args(g)

    r = sub.add_parser("run", help="replay a workload at several concurrencies and write a report")
    r.add_argument("--out", required=True)
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    r.add_argument("--sessions", type=int, default=8, help="sessions replayed per concurrency level")
    r.add_argument("--config", help="serve config (config.yaml) or a YAML mapping of build_app args")
    r.add_argument("--override", action="append", default=[], help="YAML merged into the app args")
    r.add_argument("--model-path", help="checkpoint dir to serve (model.path)")
    r.add_argument("--url", help="drive this running server instead of starting one")
    r.add_argument("--model", help="model name to request (default: the server's first)")
    r.add_argument("--tokenizer", help="with --url: checkpoint dir to count generated chat prompts")
    r.add_argument("--vocab-size", type=int, help="for hash-id traces with --url")
    r.add_argument("--trace", help="trace file (ours or AgentX form); default: generate one")
    r.add_argument("--trace-block-size", type=int, default=512, help="AgentX traces: tokens per hash block")
    r.add_argument("--replay-block-tokens", type=int, help="AgentX traces: replay each hash block as this many tokens")
    r.add_argument("--think-scale", type=float, default=1.0, help="multiply think times (0: none)")
    r.add_argument("--gpus", type=float, default=1)
    r.add_argument("--kv-block-size", type=int, help="for theoretical reuse (default: the engine's)")
    r.add_argument("--num-cpus", type=int)
    r.add_argument("--label")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--ray-logs", action="store_true", help="show the Ray workers' logs")
    _workload_args(r)

    p = sub.add_parser("report", help="re-render summaries and plots of run directories")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--gpus", type=float)
    p.add_argument("--kv-block-size", type=int)
    p.add_argument("--out", help="combined plot path when several runs are given")

    a = ap.parse_args(argv)
    {"gen": cmd_gen, "run": cmd_run, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
