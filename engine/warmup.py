"""The engine's warm-up: short requests run at start, so that kernel builds and graph captures
are paid before the first user's request (LLMEngine.warmup)."""
from __future__ import annotations

import logging

from wideep_kernels.indexer import warm_up as indexer_warm_up
from wideep_kernels.mla_decode import warm_up as mla_warm_up

from .errors import RequestError
from .sampling import SamplingParams

log = logging.getLogger(__name__)


def warm_up(engine) -> None:
    """Run short requests before the first real one: the Triton kernels build a variant per
    shape class on first use (up to a second each) and decode graphs are captured, so that
    cost is paid at start, not by the first users (a build met mid-serving stalls every running
    request). The shape classes are what the kernels specialise on: integer arguments equal to 1,
    multiples of 16 or neither (token and row counts, batch sizes), the MoE GEMM's tile by
    rows per expert, the tuned attention configuration by batch bucket, and the prefill rows
    past index_topk and their prefix-hit replay. Widths that grow with context were made
    shape-neutral in the kernels instead. Then the CUDA graphs of every batch size for the
    contexts below cuda_graph_min_tokens. Leaves no request, used block or statistic behind.
    On a rank of an expert-parallel group every rank must call it at the same time: its
    requests step with the group's (generate), its captures are made by all ranks together."""
    cfg, mc = engine.cfg, engine.model_cfg
    limit = engine.max_model_len - 4
    vocab = mc.vocab_size

    def prompt(n: int, salt: int = 0) -> list[int]:
        return [4 + (i * 7919 + salt * 104729) % (vocab - 4) for i in range(n)]

    def run(prompts: list[list[int]]) -> None:
        if prompts:
            engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))

    chunk = cfg.max_num_batched_tokens
    # One prompt per step (no two share a prefix): token counts 1, 17 and 64, and fractions
    # of a full prefill chunk.
    for n in sorted({1, 17, 64, max(1, chunk // 4), max(1, chunk // 2), chunk}):
        if n <= limit:
            run([prompt(n, salt=n)])
    # Decode batches of 3 and of 16 sequences (graph buckets 4 and 16).
    run([prompt(5, salt=-1 - s) for s in range(3)])
    # The sampler's kernels: a top-p without a top-k is cut by wideep_kernels/nucleus.py's
    # passes, after the penalties' kernel.
    engine.generate([prompt(5, salt=-30)], SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, seed=0,
                                                        frequency_penalty=0.1, repetition_penalty=1.1,
                                                        ignore_eos=True))
    if engine.tokenizer is not None:
        # Structured output: the grammar compiler's walk of the vocabulary (seconds at 129K
        # tokens) and the mask's kernel, paid here rather than by the first such request.
        # A tokenizer the grammar library cannot read fails here as it does each such request
        # (a 400 that says so): serving without structured output goes on.
        try:
            engine.compile_grammar(SamplingParams(structured_output={"kind": "json_object"}))
        except RequestError as e:
            log.warning("%s", e)
        else:
            engine.generate([prompt(5, salt=-31)], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True,
                                                                structured_output={"kind": "json_object"}))
    run([prompt(5, salt=-10 - s) for s in range(min(16, cfg.max_num_seqs))])
    if mc.index_topk:
        # Prefill rows past index_topk, in a full and a partial chunk, then a next turn on the
        # same prefix: a prefix hit whose window is replayed. Two sequences, decoding for as many
        # steps as the second one's prefill takes and a few more, so that some decode steps score
        # past index_topk at a batch past 1 (whose query rows lie in the projections' output, where
        # a lone row's have a buffer of their own).
        n = mc.index_topk + chunk + 17
        decode = -(-n // chunk) + 3
        if n + decode <= limit:
            engine.generate([prompt(n, salt=-100), prompt(n, salt=-102)],
                            SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
            run([prompt(n, salt=-100) + prompt(8, salt=-101)])
    if cfg.decode_kernels:
        # The attention kernel's tuned configuration of every batch bucket: decode batches and
        # the row counts of prefill chunks.
        kv = engine.runner.kv
        mla_warm_up(mc.num_attention_heads, mc.kv_lora_rank, mc.qk_rope_head_dim, engine.runner.dtype,
                    kv.global_kv.dtype, engine.runner.device, max(cfg.max_num_seqs, chunk), mc.index_topk,
                    mc.sliding_window, cfg.block_size)
        if mc.index_topk:  # the top-k selection's variants by row count and by row width
            indexer_warm_up(mc.index_topk, engine.runner.device, max(cfg.max_num_seqs, chunk))
    if engine.runner.graphs is not None:
        # Every batch size's graph for the short contexts (cuda_graph_min_tokens): the requests
        # above met only some of them, and each first met while serving stalls every request.
        engine.runner.graphs.capture_short()
        engine.runner.graphs.forget_serving()
    s = engine.scheduler
    s.prefix_hit_tokens = s.replayed_tokens = s.num_preemptions = 0
    if engine.prompts.grammars is not None:
        engine.prompts.grammars.compiles, engine.prompts.grammars.compile_s = 0, 0.0
    engine.num_steps = engine.num_steps_ahead = 0
    for moe in engine.runner.model.moe_layers():
        moe.take_load()
    if engine.ep is not None:
        engine.ep.wait_s = 0.0

