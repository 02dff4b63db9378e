"""One-process generation from the command line: `python -m engine.generate --model tiny --prompt ...`."""
from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .llm_engine import LLMEngine
from .sampling import SamplingParams


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny", help="checkpoint directory or preset name")
    ap.add_argument("--prompt", action="append", help="a user message (repeat for a batch)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    engine = LLMEngine.from_pretrained(args.model, EngineConfig(device=args.device, dtype=args.dtype))
    prompts = [[{"role": "user", "content": p}] for p in (args.prompt or ["Hello, who are you?"])]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt[0]['content']}\n{out.text!r}  [{len(out.output_token_ids)} tokens, {out.finish_reason}]")
    n = sum(len(o.output_token_ids) for o in outputs)
    print(f"{n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s); random weights give random text", file=sys.stderr)


if __name__ == "__main__":
    main()
