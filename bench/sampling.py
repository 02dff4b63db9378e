"""What sampling costs a decode step, per kind of request, at a real vocabulary.

    python -m bench.sampling --device cuda --batches 1 16 64 --vocab 32000 129280

For each batch and vocabulary: random logits [batch, vocab] in the model's dtype, then what the
engine runs on them after a decode forward (ModelRunner.sample, LLMEngine._launch): the logit
adjustments of penalties and bias (`adjust_logits`, with a row of output counts per sequence in
`TokenCounts`), the sampler, and the log-probability records (`token_logprobs`), every row of
the batch asking for the same kind. Two figures a kind, medians over `--iters` calls:

- device_ms: the GPU's time alone. A sleep kernel is queued first, so the host has launched the
  whole call before the GPU reaches it and the events measure no launch gaps.
- wall_ms: launch to result on the host (each call synchronised): what the step waits for when
  nothing overlaps it.

For the kinds that cut with top-k or top-p, the same call with the sampler's reference filter
(`Sampler.filter_by_sort`: sorting whole rows) is timed beside it, in the columns `sort ...`.
With --flashinfer, FlashInfer's cuts are timed beside them too (`top_k_renorm_probs`,
`top_p_renorm_probs` on the softmax, then the same exponential race), in the columns `fi ...`,
with `fi same rows`: the share of rows whose kept tokens are exactly the engine's.

The kinds are a greedy row, plain sampling (temperature), top-k 50, top-p 0.9, both, logprobs
with 0, 5 and 20 alternatives, the three penalties (presence, frequency, repetition) over
`--outputs` tokens already produced and a prompt of as many, and a bias on 50 tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from engine.logprobs import token_logprobs
from engine.penalties import TokenCounts, adjust_logits
from engine.sampling import Sampler, SamplingParams

KINDS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_p=0.9": dict(temperature=0.8, top_p=0.9),
    "top_k+top_p": dict(temperature=0.8, top_k=50, top_p=0.9),
    "logprobs=0": dict(temperature=0, logprobs=0),
    "logprobs=5": dict(temperature=0, logprobs=5),
    "logprobs=20": dict(temperature=0, logprobs=20),
    "penalties": dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "logit_bias": dict(temperature=0, logit_bias={t: -5.0 for t in range(100, 150)}),
}


class SortingSampler(Sampler):
    _filter = staticmethod(Sampler.filter_by_sort)


def make_call(kind: str, batch: int, vocab: int, outputs: int, device: str, dtype: torch.dtype,
              sampler: Sampler):
    """The engine's sampling work for one step of `batch` rows of this kind, as a closure."""
    params = [SamplingParams(max_tokens=outputs + 1000, **KINDS[kind]) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device, dtype)
    seqs = [SimpleNamespace(params=p, penalty_row=None, penalty_counted=0, is_finished=False, prior_output_ids=[],
                            prompt_ids=torch.randint(vocab, (outputs,), generator=gen).tolist(),
                            output_ids=torch.randint(vocab, (outputs,), generator=gen).tolist())
            for p in params]
    counts = TokenCounts(vocab, torch.device(device))
    generators = [None] * batch

    def call():
        adjusted = logits
        if any(p.adjusts_logits for p in params):
            penalized = [s for s in seqs if s.params.penalized]
            for s in penalized:  # one new token a step, as in decoding
                s.output_ids.append(int(s.penalty_counted) % vocab)
            adjusted = adjust_logits(logits, params, counts, counts.rows(penalized) if penalized else None)
        tokens = sampler.sample(adjusted, params, generators)
        rows = [j for j, p in enumerate(params) if p.logprobs is not None]
        if rows:
            return token_logprobs(logits, tokens, rows, max(params[j].logprobs for j in rows))
        return tokens
    return call


def flashinfer_calls(kind: str, batch: int, vocab: int, device: str, dtype: torch.dtype):
    """(FlashInfer's cuts and sampling for this kind, as a closure; the share of rows whose kept
    tokens match the engine's filter) on the same logits as make_call's."""
    import flashinfer.sampling as fi

    spec = KINDS[kind]
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device, dtype)
    top_p = torch.full((batch,), spec.get("top_p", 1.0), device=device)

    def cut():
        probs = (logits.float() / spec["temperature"]).softmax(-1)
        if "top_k" in spec:
            probs = fi.top_k_renorm_probs(probs, spec["top_k"])
        return fi.top_p_renorm_probs(probs, top_p) if "top_p" in spec else probs

    def call():
        probs = cut()
        return (probs / torch.empty_like(probs).exponential_(1.0)).argmax(-1)

    ours = Sampler._filter(logits.float() / spec["temperature"], [SamplingParams(**spec)] * batch).isfinite()
    same = (ours == (cut() > 0)).all(-1).float().mean().item()
    return call, same


def measure(call, device: str, iters: int) -> dict:
    for _ in range(3):
        call()
    walls, devs = [], []
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    if device.startswith("cuda"):
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(20_000_000)  # ~10 ms: longer than the host needs to launch a call
            start.record()
            call()
            end.record()
            end.synchronize()
            devs.append(start.elapsed_time(end))
    return {"device_ms": statistics.median(devs) if devs else None, "wall_ms": statistics.median(walls)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 129280])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--outputs", type=int, default=1024, help="tokens each penalized row has produced")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="append each row to this file as a JSON line")
    ap.add_argument("--flashinfer", action="store_true", help="time FlashInfer's top-k / top-p cuts beside ours")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print("| vocab | batch | kind | device ms | wall ms | sort device ms | sort wall ms |"
          + (" fi device ms | fi wall ms | fi same rows |" if args.flashinfer else "")
          + "\n|---|---|---|---|---|---|---|" + ("---|---|---|" if args.flashinfer else ""))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for vocab in args.vocab:
        for batch in args.batches:
            for kind in args.kinds:
                row = dict(vocab=vocab, batch=batch, kind=kind, **measure(
                    make_call(kind, batch, vocab, args.outputs, args.device, dtype, Sampler()), args.device, args.iters))
                if "top_" in kind:
                    sort = measure(make_call(kind, batch, vocab, args.outputs, args.device, dtype, SortingSampler()),
                                   args.device, args.iters)
                    row.update(sort_device_ms=sort["device_ms"], sort_wall_ms=sort["wall_ms"])
                    if args.flashinfer:
                        call, same = flashinfer_calls(kind, batch, vocab, args.device, dtype)
                        theirs = measure(call, args.device, args.iters)
                        row.update(fi_device_ms=theirs["device_ms"], fi_wall_ms=theirs["wall_ms"], fi_same_rows=same)
                fi = (f" {fmt(row.get('fi_device_ms'))} | {fmt(row.get('fi_wall_ms'))} | {fmt(row.get('fi_same_rows'))} |"
                      if args.flashinfer else "")
                print(f"| {vocab} | {batch} | {kind} | {fmt(row['device_ms'])} | {fmt(row['wall_ms'])} | "
                      f"{fmt(row.get('sort_device_ms'))} | {fmt(row.get('sort_wall_ms'))} |{fi}", flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    main()
