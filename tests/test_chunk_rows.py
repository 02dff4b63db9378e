"""Prompt chunks as kernel rows (ModelRunner.chunk_forward, replayed from CUDA graphs on a GPU):
each token a row of the decode kernels, several rows a sequence, beside decoding sequences.

On CPU the runner gets a stand-in for its graphs that runs the same functions eagerly on the
same input buffers, padding included; every request must come out as the padded path makes it.
"""
import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams


class EagerGraphs:
    """DecodeGraphs' interface without graphs: rows padded to a multiple of 4, block tables to
    a multiple of 8 entries, as the captured shapes would be."""

    def __init__(self, runner, max_rows=64):
        self.runner, self.max_rows, self.chunks, self.logit_rows = runner, max_rows, [], []

    def covers(self, n):
        return n <= self.max_rows

    covers_chunk = covers

    def run(self, batch, longest=None, ahead_ids=None):
        r = self.runner
        ids, *rest = r.decode_inputs(batch, ahead=int(ahead_ids is not None))
        if ahead_ids is not None:
            ids[:len(batch)].copy_(ahead_ids)
        return r.decode_forward(ids, *rest)

    def run_chunk(self, batch, rows, shape=None, ahead_ids=None):
        # a lockstep group's shape, a step launched ahead as chunk rows: only with expert parallelism
        assert shape is None and ahead_ids is None
        r = self.runner
        self.chunks.append(list(batch.num_tokens))
        pad_r = -(-rows // 4) * 4
        longest = max(seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens))
        pad_m = -(-r.decode_width(batch, longest) // 8) * 8
        host = np.random.default_rng(0).integers(0, 255, r.chunk_input_bytes(pad_r, pad_m)[1], dtype=np.uint8)
        sparse, logit_rows = r.fill_chunk_inputs(batch, host, pad_r, pad_m)
        views = r.chunk_input_views(torch.from_numpy(host), pad_r, pad_m)
        logits = r.chunk_forward(*views, sparse)
        self.logit_rows.append((pad_r, logits.shape[0]))
        return logits[:len(logit_rows)]


def _engine(ckpt, chunks: bool, **cfg):
    cfg = dict(dict(block_size=4, num_blocks=256, max_num_seqs=8), **cfg)
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)
    if chunks:
        engine.runner.graphs = EagerGraphs(engine.runner)
    return engine


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _two_turns(e, prompts, params):
    """Every request's output tokens, and the logits of every sampled step, over the prompts and
    then a next turn on the first two (prefix hits)."""
    seen, sample = [], e.runner.sample
    e.runner.sample = lambda seqs, lg: (seen.append(lg.clone()), sample(seqs, lg))[1]
    first = e.generate(prompts, params)
    second = e.generate([p + [7, 8, 9] for p in prompts[:2]], params)
    return [o.output_token_ids for o in first + second], seen


@pytest.mark.parametrize("which,budget", [("tiny", 24), ("tiny-v4", 8), ("tiny-v4", 24)])
def test_chunk_rows_compute_what_the_padded_path_computes(which, budget, tiny_ckpt, tiny_v4_ckpt):
    """Prompts alone, several in a step, in chunks of a small token budget (a later chunk reads
    the ring and KV the earlier wrote), beside decoding sequences, and a second turn that hits the
    prefix cache (tiny-v4: its window replayed, rows that write no global KV). tiny-v4's window
    is 8 tokens: at a budget of 24 a sequence's chunk is up to three windows long, and only its
    last 8 rows may stay in the ring."""
    ckpt = tiny_ckpt if which == "tiny" else tiny_v4_ckpt
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = _prompts([5, 21, 2, 13, 30])
    outs, logits = {}, {}
    for chunks in (False, True):
        e = _engine(ckpt, chunks, max_num_batched_tokens=budget)
        outs[chunks], logits[chunks] = _two_turns(e, prompts, params)
        assert e.scheduler.blocks.num_used_blocks == 0
        if chunks:
            assert len(e.runner.graphs.chunks) >= 4 and any(len(c) > 1 for c in e.runner.graphs.chunks)
            # The LM head runs on a row per sequence that can be due (max_num_seqs 8), not on every token.
            assert all(n == min(pad, 8) for pad, n in e.runner.graphs.logit_rows)
            assert which == "tiny-v4" or any(pad > 8 for pad, _ in e.runner.graphs.logit_rows)
            assert e.scheduler.prefix_hit_tokens > 0
            if which == "tiny-v4":
                assert e.scheduler.replayed_tokens > 0
                assert budget == 8 or any(n > 8 for c in e.runner.graphs.chunks for n in c)
    assert outs[True] == outs[False]
    assert len(logits[True]) == len(logits[False])
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_which_steps_the_chunk_rows_take(tiny_v4_ckpt):
    e = _engine(tiny_v4_ckpt, True, max_num_batched_tokens=64)
    r = e.runner
    e.add_request("long", _prompts([9])[0], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    batch = e.scheduler.schedule()
    assert batch.num_tokens == [9] and r.chunk_rows(batch) == 9  # longer than the window of 8: taken
    # Only its last 8 rows write the sequence's ring; the first row and the padding write the
    # scratch ring (on a GPU, rows writing one ring entry would land in any order).
    host = np.zeros(r.chunk_input_bytes(12, 4)[1], dtype=np.uint8)
    r.fill_chunk_inputs(batch, host, 12, 4)
    ring_write = r.chunk_input_views(torch.from_numpy(host), 12, 4)[7]
    slot, scratch = batch.seqs[0].window_slot, r.kv.scratch_window
    assert ring_write.tolist() == [scratch] + [slot] * 8 + [scratch] * 3
    e2 = _engine(tiny_v4_ckpt, True, max_num_batched_tokens=64)
    e2.runner.graphs.max_rows = 4
    e2.add_request("a", _prompts([3])[0], SamplingParams(max_tokens=2))
    e2.add_request("b", _prompts([3], seed=1)[0], SamplingParams(max_tokens=2))
    assert e2.runner.chunk_rows(e2.scheduler.schedule()) == 0  # 6 rows, more than the graphs hold


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("which,kv", [("tiny", "auto"), ("tiny-v4", "auto"), ("tiny-v4", "fp8_e4m3")])
def test_chunk_graphs_on_cuda_match_the_eager_padded_path(which, kv, tiny_ckpt, tiny_v4_ckpt):
    """On the GPU the chunk steps replay captured graphs (a capture's warm-up run must leave the
    window rings as they were); the outputs are the eager padded path's, FP8 KV included."""
    ckpt = tiny_ckpt if which == "tiny" else tiny_v4_ckpt
    budget = 24  # tiny-v4: chunks of up to three windows, and ones within a window
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = _prompts([5, 21, 2, 13, 30])
    outs, logits = {}, {}
    for graphs in (False, True):
        e = _engine(ckpt, False, device="cuda", cuda_graphs=graphs, max_num_batched_tokens=budget, warmup=False,
                    kv_cache_dtype=kv)
        outs[graphs], logits[graphs] = _two_turns(e, prompts, params)
        if graphs:
            assert any(key[0] == "chunk" for key in e.runner.graphs.graphs)
    assert outs[True] == outs[False]
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # One sequence at a time, as a batch-1 server runs: its whole short prompt is one chunk graph.
    e = _engine(ckpt, False, device="cuda", max_num_seqs=1, max_num_batched_tokens=512, warmup=False)
    e.generate(_prompts([30 if which == "tiny" else 7]), params)
    assert any(key[:2] == ("chunk", 32 if which == "tiny" else 8) for key in e.runner.graphs.graphs)


def test_chunk_graph_sizes():
    """The decode sizes up to 128 rows, then powers of two up to the most tokens a chunk step
    takes: few graphs (each captured once a block-table width) for the large steps."""
    from engine.cuda_graphs import _chunk_sizes
    assert _chunk_sizes(512) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 256, 512]
    assert _chunk_sizes(300)[-2:] == [256, 300]
    assert _chunk_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert _chunk_sizes(2048)[-4:] == [256, 512, 1024, 2048]
