"""After the engine's warm-up, serving builds no new Triton kernel variant.

Triton builds a kernel once per variant: its constexpr values, launch options, pointer dtypes
and 16-byte alignment, and, for each integer argument not listed in do_not_specialize, whether
it is 1, a multiple of 16, or neither. A variant first met while serving stalls every running
request while it builds (up to a second or so on a GPU). The CPU interpreter builds nothing,
so this test records the variant keys that the interpreted launches would have built, following
those rules, through the warm-up and then through requests of other lengths, batch sizes and
prefix hits.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch
    from triton.runtime.interpreter import InterpretedFunction

    def int_class(v):
        return "1" if v == 1 else ("d16" if v % 16 == 0 else "any") + ("64" if abs(v) >= 2**31 else "")

    builds, phase = {}, ["start"]
    launch = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        # as Triton reads do_not_specialize: by position or name, names not among the arguments ignored
        listed = self.kwargs.get("do_not_specialize") or ()
        plain = {i for i, name in enumerate(names) if i in listed or name in listed}
        sig = []
        for i, v in enumerate(args):
            if isinstance(v, torch.Tensor):
                sig.append((str(v.dtype), v.data_ptr() % 16 == 0))
            elif isinstance(v, bool) or not isinstance(v, int):
                sig.append(type(v).__name__)
            else:
                sig.append("int" if i in plain else int_class(v))
        consts = tuple(sorted((k, v) for k, v in kwargs.items()))
        builds.setdefault((self.fn.__name__, tuple(sig), consts), phase[0])
        return launch(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    cfg = EngineConfig(block_size=16, max_num_batched_tokens=32, max_num_seqs=16, num_blocks=256)
    engine = LLMEngine.from_pretrained(sys.argv[1], cfg, progress=False)
    phase[0] = "warmup"
    engine.warmup()
    warm = {k for k, v in builds.items() if v == "warmup"}
    kernels = {k[0] for k in warm}
    phase[0] = "serve"
    g = torch.Generator().manual_seed(1)
    def prompts(*lengths):
        return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    long = prompts(83)[0]
    # (a context several times the warm-up's longest: row widths the warm-up never had)
    outs = []
    for batch in ([long], prompts(2), prompts(39), prompts(7, 12, 30, 45, 61), prompts(*([9] * 16)),
                  [long + prompts(11)[0]], [long + prompts(3)[0], *prompts(50, 20)], prompts(300)):
        outs += engine.generate(batch, p)
    # sampled rows: a top-p without a top-k takes the nucleus kernel, beside rows with a top-k and a
    # penalized row
    sampled = [dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=0.7, top_p=0.5, presence_penalty=0.5),
               dict(temperature=1.0, top_k=5, top_p=0.8)]
    outs += engine.generate(prompts(6, 9, 14), [SamplingParams(max_tokens=3, ignore_eos=True, **kw) for kw in sampled])
    # grammar rows, one and five of them (their rows sit at other offsets of the mask's buffer);
    # a grammar no answer of 3 tokens completes, so that every request ends by length
    letters = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                             structured_output={"kind": "regex", "value": "[a-z ]{64}"})
    outs += engine.generate(prompts(7), letters) + engine.generate(prompts(4, 5, 6, 7, 8), letters)
    print("REASONS", sorted({o.finish_reason for o in outs}))
    new = sorted(k for k, v in builds.items() if v == "serve")
    print("KERNELS", sorted(kernels))
    print("NEW", len(new))
    for k in new:
        print(k)
""")


# Every request runs to its end through the interpreted kernels: about 10 minutes on 2 cores.
@pytest.mark.timeout(1800)
def test_serving_after_warmup_builds_no_new_kernel_variant(tiny_v4_ckpt):
    env = dict(os.environ, TRITON_INTERPRET="1", WIDEEP_CPU_KERNELS="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_v4_ckpt)], env=env, capture_output=True, text=True,
                       timeout=1700, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    kernels = next(line for line in lines if line.startswith("KERNELS"))
    assert "REASONS ['length']" in lines, "\n".join(lines[-40:])  # every request ran to its end
    assert "NEW 0" in lines, "\n".join(lines[-40:])
    # the warm-up went through the kernel path, not the references
    for name in ("_split_kernel", "_score_tile_kernel", "_select_kernel", "_radix_pass_kernel", "_emit_chunk_kernel",
                 "_count_chunk_kernel", "_route_kernel", "_gate_up_kernel", "_align_one_kernel", "_mass_kernel",
                 "_penalties_kernel", "_apply_token_mask_kernel", "_race_kernel"):
        assert name in kernels, kernels
