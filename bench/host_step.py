"""Host-side work of a decode step outside the forward, against context length (CPU).

    python -m bench.host_step --batch 16 --contexts 8192 131072 524288

`batch` running sequences of `context` tokens, made up as bench.forward makes them (the tiny
model; nothing here depends on the model's size), then for each step: the step's input tensors
(`decode_inputs`), and after the forward the prefix cache's block hashing (`publish`) and the
output records (`_append`: stop checks, the RequestOutput); `--output-tokens N`: the last N of
each context's tokens were generated (outputs), not prompted. Median microseconds per step over
`iters` steps. On a GPU this time adds to the forward's: the engine prepares a step between two.

    python -m bench.host_step --admission --contexts 8192 131072

`--whole-step`: instead, the median of the engine's whole `step()` (schedule, inputs, sampling,
outputs) with the model's forward replaced by zero logits, for `batch` requests decoding.

    python -m bench.host_step --whole-step --batch 64 --contexts 2048 \
        --sampling plain logprobs=0 logprobs=5 logprobs=20 penalties logit_bias

`--sampling`: the whole step once per kind of request, side by side in one run, with the tiny
model's tokenizer (naming tokens and detokenizing, as served): `logprobs=K` asks for logprobs
with K alternatives, `penalties` for presence, frequency and repetition penalties, `logit_bias`
for a bias on 50 tokens.

`--admission`: the prefix-cache lookup of a request whose whole prompt of `context` tokens is
cached, as admission runs it on every attempt (each step while the pool is full): the first
attempt, a retry, and hashing every block's tokens again (what each attempt cost before the
sequences kept their chain of block hashes). Milliseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_vs_hf import build_ours
from bench.forward import make_batch
from engine.block_manager import BlockManager, block_hash
from engine.config import EngineConfig, preset
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer, build_tokenizer


def measure(model, batch_size: int, context: int, iters: int, output_tokens: int = 1) -> dict:
    bs = 64
    blocks = batch_size * (-(-(context + iters + 1) // bs) + 1)
    engine = LLMEngine(model, None, EngineConfig(device="cpu", dtype="float32", block_size=bs, num_blocks=blocks,
                                                 max_num_seqs=batch_size, max_model_len=context + iters + 2))
    batch = make_batch(engine, batch_size, context)
    for seq in batch.seqs:  # the last output_tokens of each context generated rather than prompted
        moved = seq.prompt_ids[len(seq.prompt_ids) - (output_tokens - 1):] if output_tokens > 1 else []
        del seq.prompt_ids[len(seq.prompt_ids) - len(moved):]
        seq.output_ids[:0] = moved
    for seq in batch.seqs:  # room to grow by `iters` tokens, and the prompt's blocks already hashed
        seq.block_table += [seq.block_table[-1] + 1 + i for i in range(-(-iters // bs) + 1)]
        engine.scheduler.blocks.publish(seq)
    times = {"decode_inputs": [], "publish": [], "append": []}
    for _ in range(iters):
        t0 = time.perf_counter()
        engine.runner.decode_inputs(batch)
        t1 = time.perf_counter()
        for seq in batch.seqs:
            seq.num_computed_tokens += 1
            engine.scheduler.blocks.publish(seq)
        t2 = time.perf_counter()
        for seq in batch.seqs:
            engine._append(seq, 7)
        t3 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(dt * 1e6)
    row = {f"{k}_us": round(statistics.median(v), 1) for k, v in times.items()}
    return dict(batch=batch_size, context=context, output_tokens=output_tokens, **row,
                total_us=round(sum(row.values()), 1))


SAMPLING_KINDS = {"plain": {}, "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
                  "logit_bias": dict(logit_bias={t: -5.0 for t in range(10, 60)})}


def sampling_kind(name: str) -> dict:
    if name.startswith("logprobs="):
        return {"logprobs": int(name.split("=", 1)[1])}
    return SAMPLING_KINDS[name]


def whole_step(model, batch_size: int, prompt: int, iters: int, sampling: dict | None = None,
               tokenizer=None) -> dict:
    engine = LLMEngine(model, tokenizer, EngineConfig(device="cpu", dtype="float32", block_size=64,
                                                      num_blocks=batch_size * (-(-(prompt + 3 * iters) // 64) + 2),
                                                      max_num_seqs=batch_size, max_model_len=prompt + 3 * iters + 8))
    vocab = model.cfg.vocab_size
    for i in range(batch_size):
        engine.add_request(f"r{i}", [5 + t % (vocab - 5) for t in range(prompt)], SamplingParams(max_tokens=3 * iters, temperature=0,
                                                                              ignore_eos=True, **(sampling or {})))
    while any(s.num_computed_tokens < len(s.prompt_ids) for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # the prefills, with the real forward
    # varied logits, so that the sampled tokens (and the tokens logprobs name) vary
    engine.runner.decode_forward = lambda ids, *rest: torch.randn(ids.shape[0], vocab)
    for _ in range(10):
        engine.step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e6)
    return dict(batch=batch_size, prompt=prompt, step_us=round(statistics.median(times), 1))


def _tiny_tokenizer(vocab: int) -> Tokenizer:
    path = Path(tempfile.mkdtemp(prefix="host-step-tok-"))
    build_tokenizer(vocab).save_pretrained(str(path))
    return Tokenizer(path)


def admission(context: int, block_size: int = 64) -> dict:
    blocks = BlockManager(context // block_size + 8, block_size)
    tokens = torch.randint(4, 30000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    owner = Sequence("cached", tokens, SamplingParams())
    blocks.grow(owner, context)
    owner.num_computed_tokens = context
    blocks.publish(owner)
    seq = Sequence("next-turn", tokens + [7] * 16, SamplingParams())

    def timed(fn):
        t0 = time.perf_counter()
        out = fn()
        return out, round((time.perf_counter() - t0) * 1e3, 3)

    def rehash():  # as each attempt did before: the whole token list, then every block hashed
        prev, ids = b"", seq.token_ids
        for i in range(context // block_size):
            prev = block_hash(prev, ids[i * block_size:(i + 1) * block_size])

    _, rehash_ms = timed(rehash)
    hits, first_ms = timed(lambda: blocks.match_prefix(seq))
    again, retry_ms = timed(lambda: blocks.match_prefix(seq))
    assert hits == again and len(hits) == context // block_size
    return dict(context=context, hit_blocks=len(hits), rehash_ms=rehash_ms, first_ms=first_ms, retry_ms=retry_ms)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072, 524288])
    ap.add_argument("--output-tokens", type=int, default=1, help="tokens of each context already generated")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--admission", action="store_true", help="time the prefix-cache lookup of admission instead")
    ap.add_argument("--whole-step", action="store_true", help="time engine.step() with the forward stubbed instead")
    ap.add_argument("--sampling", nargs="+", default=None,
                    help="--whole-step: plain, logprobs=K, penalties, logit_bias; each side by side")
    ap.add_argument("--json", default=None, help="append JSON lines here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.whole_step:
        model = build_ours(preset("tiny", max_position_embeddings=max(args.contexts) + 3 * args.iters + 16), "cpu",
                           torch.float32)
        if args.sampling:
            tokenizer = _tiny_tokenizer(model.cfg.vocab_size)
            rows = [dict(whole_step(model, args.batch, c, args.iters, sampling_kind(k), tokenizer), sampling=k)
                    for c in args.contexts for k in args.sampling]
        else:
            rows = [dict(whole_step(model, args.batch, c, args.iters), sampling="plain") for c in args.contexts]
        print("| batch | prompt | requests | engine step us (forward stubbed) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['prompt']} | {r['sampling']} | {r['step_us']} |")
    elif args.admission:
        rows = [admission(c) for c in args.contexts]
        print("| context | cached blocks | hash every block ms | first lookup ms | retry ms |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['context']} | {r['hit_blocks']} | {r['rehash_ms']} | {r['first_ms']} | {r['retry_ms']} |")
    else:
        model = build_ours(preset("tiny", max_position_embeddings=max(args.contexts) + args.iters + 4), "cpu",
                           torch.float32)
        rows = [measure(model, args.batch, c, args.iters, args.output_tokens) for c in args.contexts]
        print("| batch | context | generated | decode_inputs us | publish us | append us | total us |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['context']} | {r['output_tokens']} | {r['decode_inputs_us']} | "
                  f"{r['publish_us']} | {r['append_us']} | {r['total_us']} |")
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
