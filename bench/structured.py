"""What structured output costs a decode step: compiling a grammar, filling each constrained
row's mask on the host, and applying the masks to the logits.

    python -m bench.structured --vocab 129280 --batches 1 16 64 [--device cuda]

The vocabulary is synthetic (no DeepSeek tokenizer is at hand here): every byte, then words and
fragments of words of 2 to 12 letters, digits and punctuation, with and without a leading space,
as many as --vocab asks. The grammar is a tool's JSON schema like an agent sends (strings, an
enum, numbers, an array of objects). A step's fill is timed along a generation: each row takes a
random allowed token after each fill (seeded), so the rows pass through keys, strings, numbers
and structure as a model's answer would. Figures:

- compile_ms: the schema's first compile at this vocabulary, and a compile found in the cache;
  tools_tag_compile_ms: the structural tag of 8 strict tools of this schema (app/call_grammars.py:
  what an agent's turn with strict tools compiles once);
- fill_us_per_row: median and 90th percentile of one row's fill (xgrammar's matcher);
- step host ms: the fills of a batch one row at a time, every row constrained, plus the accept
  of each token; batch fill ms: the same fills as the engine runs them (fill_masks, over
  FILL_THREADS threads);
- apply ms: the masks applied to [batch, vocab] logits by the kernel and by the torch reference
  (on CUDA, device time; on CPU only the reference, the kernel being interpreted there).

With --engine-preset (e.g. `bench`): decode steps of that preset's random model, its vocabulary
made --vocab tokens, at each batch, every row plain, under a regex, under the JSON schema, or penalized;
the grammars read the synthetic vocabulary, so a step's fills cost what they would at that size.
Each row also says where the host's time went a step (see _engine_mode): fill_ms (the masks),
wait_ms (blocked on the device: the step is bound by the GPU when this is most of step_ms, by the
host when it is near 0), and the sections around them. --fill-threads N ... times the fills (and
the constrained modes' steps) at each thread count; --profile-host prints the host's top functions
(cProfile) over an extra pass of each mode at the largest batch.

    python -m bench.structured --device cuda --vocab 129280 --batches 1 16 64 --engine-preset bench
    python -m bench.structured --device cpu --vocab 2048 --batches 2 --engine-preset tiny --engine-steps 10
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import random
import statistics
import string
import time

import torch

from app.call_grammars import calls_tag
from engine.structured import FILL_THREADS, GrammarCompiler, fill_masks, validate_spec
from wideep_kernels.token_mask import apply_token_mask, apply_token_mask_reference

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "a city name"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "stops": {"type": "array", "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "lat": {"type": "number"},
                                             "lon": {"type": "number"}}, "required": ["name", "lat", "lon"]}},
        "notes": {"type": "string"},
    },
    "required": ["city", "unit", "days", "stops"],
}


def synthetic_vocabulary(size: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = [bytes([b]).decode("latin-1") for b in range(256)] + ["<eos>"]
    seen = set(vocab)
    letters, other = string.ascii_letters, string.digits + string.punctuation
    while len(vocab) < size:
        n = rng.randint(2, 12)
        word = "".join(rng.choice(letters if rng.random() < 0.85 else other) for _ in range(n))
        word = (" " + word) if rng.random() < 0.5 else word
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    return vocab


ENGINE_MODES = {
    "plain": dict(temperature=0),
    # 100,000 letters and spaces: a grammar no row ends within the bench (every row decodes the
    # same number of steps), whose masks still cost a fill a row each step
    "regex": dict(temperature=0, structured_output={"kind": "regex", "value": "[a-z ]{100000}"}),
    "json": dict(temperature=0, structured_output={"kind": "json", "value": SCHEMA}),
    "penalties": dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.5),
}


def engine_part(args, vocab: list[str]) -> list[dict]:
    """Decode steps of the bench model with every row of one mode, async scheduling as configured
    (on by default on a GPU): a constrained or penalized row's step launches its forward ahead
    and samples once the previous token is read, its masks filled while the forward runs."""
    import engine.model_runner as model_runner
    import engine.structured as structured
    from bench.ep_decode import build
    from engine.config import EngineConfig, preset
    from engine.llm_engine import LLMEngine
    from engine.structured import Constraint

    cuda = args.device.startswith("cuda")
    cfg = preset(args.engine_preset, vocab_size=len(vocab))  # DeepSeek's vocabulary size: its lm_head and masks
    model = build(cfg, args.device, torch.bfloat16 if cuda else torch.float32)
    batch_max, prompt = max(args.batches), 32  # prompt: _engine_mode's length
    engine = LLMEngine(model, None, EngineConfig(
        device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16, max_num_seqs=batch_max,
        num_blocks=batch_max * ((prompt + 2 * args.engine_steps + 40) // 16 + 2) + 16, warmup=cuda,
        max_num_batched_tokens=max(256, batch_max * prompt)))
    engine.prompts.grammars = GrammarCompiler(None, len(vocab), [256], vocabulary=vocab)
    # where the host's time goes: (owner, attribute) timed while the steps run
    sections = {"fill": (model_runner, "fill_masks"), "mask": (model_runner.ModelRunner, "_mask_grammar"),
                "sample": (LLMEngine, "_sample"), "accept": (Constraint, "accept"), "launch": (LLMEngine, "_launch"),
                "complete": (LLMEngine, "_complete"), "wait": (torch.cuda.Event, "synchronize")}
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        for mode, kwargs in ENGINE_MODES.items():
            for threads in args.fill_threads if "structured_output" in kwargs else [None]:
                if threads is not None:
                    structured.FILL_THREADS = threads
                rows.append(_engine_mode(engine, args, vocab, g, mode, kwargs, batch, threads, sections))
                if args.profile_host and batch == max(args.batches):
                    profile = cProfile.Profile()
                    profile.enable()
                    for _ in range(args.engine_steps):
                        engine.step()
                    profile.disable()
                    print(f"host profile, {mode} at batch {batch}, {args.engine_steps} steps:")
                    pstats.Stats(profile).sort_stats("tottime").print_stats(15)
                for rid in list(engine.requests):
                    engine.abort_request(rid)
                while engine.has_unfinished_requests():
                    engine.step()
    return rows


def _engine_mode(engine, args, vocab, g, mode: str, kwargs: dict, batch: int, threads: int | None,
                 sections: dict) -> dict:
    from engine.sampling import SamplingParams

    cuda = args.device.startswith("cuda")
    for i in range(batch):
        engine.add_request(f"{mode}-{batch}-{threads}-{i}", torch.randint(300, len(vocab), (32,), generator=g).tolist(),
                           # room for --profile-host's pass after the timed one
                           SamplingParams(max_tokens=2 * args.engine_steps + 8, ignore_eos=True, **kwargs))
    for _ in range(4):  # the prompts, then the first decode steps
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    ahead0 = engine.num_steps_ahead
    spent = dict.fromkeys(sections, 0.0)
    with contextlib.ExitStack() as timers:
        for key, (owner, name) in sections.items():
            timers.enter_context(_timed(owner, name, spent, key))
        t0 = time.perf_counter()
        for _ in range(args.engine_steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) * 1e3 / args.engine_steps
    # host ms a step in each section, each counting what it calls: launch (a forward, and its
    # sampling unless deferred) and sample (both paths) hold mask (a host buffer filled, copied
    # and applied), which holds fill; complete (tokens read, outputs) holds wait (on the device)
    # and accept (the grammars' advance)
    row = {"part": "engine", "mode": mode, "batch": batch, "fill_threads": threads, "step_ms": step_ms,
           **{f"{key}_ms": spent[key] * 1e3 / args.engine_steps for key in sections}}
    row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
    row.update(steps_ahead=engine.num_steps_ahead - ahead0,
               live_rows=sum(1 for seq in engine.requests.values() if not seq.is_finished))
    print(json.dumps(row), flush=True)
    return row


@contextlib.contextmanager
def _timed(owner, name: str, spent: dict, key: str):
    """Add the seconds spent in owner.name to spent[key] while inside."""
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, fn)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", help="append the results to this file as a JSON line")
    ap.add_argument("--engine-preset", help="also time decode steps of this preset's random model (of --vocab "
                    "tokens) with every row constrained, penalized or plain")
    ap.add_argument("--engine-steps", type=int, default=50)
    ap.add_argument("--fill-threads", type=int, nargs="+", default=[FILL_THREADS], metavar="N",
                    help="threads filling a batch's masks together (default: the engine's)")
    ap.add_argument("--profile-host", action="store_true", help="with --engine-preset: the host's top functions "
                    "a mode spends its steps in, at the largest batch")
    args = ap.parse_args(argv)
    vocab = synthetic_vocabulary(args.vocab)
    eos = 256
    spec = validate_spec({"kind": "json", "value": SCHEMA})
    t0 = time.perf_counter()
    compiler = GrammarCompiler(None, args.vocab, [eos], vocabulary=vocab)
    info_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.compile(spec["kind"], spec["value"])
    cold_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.compile(spec["kind"], spec["value"])
    warm_ms = (time.perf_counter() - t0) * 1e3
    tag = calls_tag([{"name": f"tool_{i}", "parameters": SCHEMA, "strict": True} for i in range(8)])
    t0 = time.perf_counter()
    compiler.compile("structural_tag", validate_spec({"kind": "structural_tag", "value": tag})["value"])
    tag_ms = (time.perf_counter() - t0) * 1e3
    result = {"vocab": args.vocab, "tokenizer_info_ms": info_ms, "compile_ms": cold_ms, "cached_compile_ms": warm_ms,
              "tools_tag_compile_ms": tag_ms, "batches": []}
    print(f"vocabulary {args.vocab} (synthetic): tokenizer info {info_ms:.0f} ms, schema compile {cold_ms:.1f} ms, "
          f"cached {warm_ms:.3f} ms; 8 strict tools' tag {tag_ms:.1f} ms")
    words = (args.vocab + 31) // 32
    threads = args.fill_threads
    print(f"| batch | fill us/row p50 | p90 | mean | step host ms, one row at a time (fills + accepts) | "
          + "".join(f"batch fill ms ({t} threads) | " for t in threads) + "apply kernel ms | apply reference ms |")
    print("|---|---|---|---|---|" + "---|" * len(threads) + "---|---|")
    for batch in args.batches:
        rng = random.Random(batch)
        rows = [compiler.constraint(spec) for _ in range(batch)]
        mask = torch.empty(batch, words, dtype=torch.int32)
        per_row, steps, batched = [], [], {t: [] for t in threads}
        for _ in range(args.steps):
            fills = 0.0
            for j, c in enumerate(rows):
                t0 = time.perf_counter()
                c.fill(mask, j)
                per_row.append((time.perf_counter() - t0) * 1e6)
                fills += per_row[-1] / 1e3
            for t in threads:  # what the engine runs: the rows over t threads
                t0 = time.perf_counter()
                fill_masks(rows, mask, t)
                batched[t].append((time.perf_counter() - t0) * 1e3)
            allowed = [torch.nonzero(
                ((mask[j, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:args.vocab]).flatten()
                for j in range(batch)]
            picks = [int(a[rng.randrange(len(a))]) if len(a) else eos for a in allowed]
            t_accept = time.perf_counter()
            for j, c in enumerate(rows):
                if not c.finished:
                    c.accept(picks[j])
                if c.finished:  # a finished answer starts over: every row stays constrained
                    rows[j] = compiler.constraint(spec)
            accept_s = time.perf_counter() - t_accept
            # the step's host cost: the fills and the accepts, not this bench's own picking
            steps.append(fills + accept_s * 1e3)
        apply = {}
        logits = torch.randn(batch, args.vocab, device=args.device)
        dev_mask = mask.to(args.device)
        idx = torch.arange(batch, device=args.device)
        fns = {"reference": apply_token_mask_reference}
        if args.device.startswith("cuda"):
            fns["kernel"] = apply_token_mask
        for name, fn in fns.items():
            times = []
            for _ in range(20):
                x = logits.clone()
                if args.device.startswith("cuda"):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    torch.cuda._sleep(2_000_000)
                    start.record()
                    fn(x, dev_mask, idx)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fn(x, dev_mask, idx)
                    times.append((time.perf_counter() - t0) * 1e3)
            apply[name] = statistics.median(times)
        q = statistics.quantiles(per_row, n=10)
        row = {"batch": batch, "fill_us_p50": statistics.median(per_row), "fill_us_p90": q[-1],
               "fill_us_mean": statistics.fmean(per_row), "step_host_ms": statistics.median(steps),
               "batch_fill_ms": {t: statistics.median(v) for t, v in batched.items()}, "apply_ms": apply}
        result["batches"].append(row)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"| {batch} | {row['fill_us_p50']:.1f} | {row['fill_us_p90']:.1f} | {row['fill_us_mean']:.1f} | "
              f"{row['step_host_ms']:.3f} | " + "".join(f"{v:.3f} | " for v in row["batch_fill_ms"].values()) +
              f"{fmt(apply.get('kernel'))} | {fmt(apply.get('reference'))} |", flush=True)
    if args.engine_preset:
        result["engine"] = engine_part(args, vocab)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
