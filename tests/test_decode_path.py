"""The decode fast path (paged decode kernels, FP8 KV) against the padded reference path."""
import os
import subprocess
import sys
import textwrap

import pytest
from pydantic import ValidationError
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in lengths]


def _run(ckpt, prompts, **cfg):
    """Greedy outputs, every sampled step's logits, and how many steps took the decode path."""
    cfg.setdefault("block_size", 4)
    engine = LLMEngine.from_pretrained(ckpt, EngineConfig(**cfg), progress=False)
    logits, decode_steps = [], []
    sample, fwd = engine.runner.sample, engine.runner.decode_forward

    def record(seqs, lg):
        logits.append(lg.clone())
        return sample(seqs, lg)

    def counted(*args, **kwargs):  # graphs pass the shared logits buffer by keyword
        decode_steps.append(args[0].shape[0])
        return fwd(*args, **kwargs)
    engine.runner.sample, engine.runner.decode_forward = record, counted
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.blocks.num_used_blocks == 0
    return [o.output_token_ids for o in outs], logits, decode_steps


@pytest.mark.parametrize("which", ["tiny", "tiny-v4"])
def test_decode_kernels_match_padded_path(which, tiny_ckpt, tiny_v4_ckpt):
    # tiny-v4: window 8, index_topk 16 -> prompts of 30+ tokens take the sparse (top-k) path.
    ckpt = tiny_ckpt if which == "tiny" else tiny_v4_ckpt
    prompts = _prompts([3, 30, 45, 1])
    fast, fast_logits, steps = _run(ckpt, prompts, decode_kernels=True)
    slow, slow_logits, none = _run(ckpt, prompts, decode_kernels=False)
    assert steps and not none  # the fast path really ran, and only when asked
    assert fast == slow
    for a, b in zip(fast_logits, slow_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [512, 7])
def test_kernel_path_after_prefix_hit_and_preemption(tiny_v4_ckpt, chunk):
    # A second request sharing a prefix (bounded replay: its ring starts empty mid-sequence),
    # prefill chunks of 7 tokens (chunks start inside the window), and a pool so small that
    # sequences are preempted and recomputed. Prefill rows and decode rows both take the kernel
    # path here (tiny-v4 is sparse); decode_kernels=False is the padded reference.
    shared = _prompts([40])[0]
    prompts = [shared + [7, 8, 9], shared + [10], _prompts([37], seed=3)[0]]
    kw = dict(num_blocks=30, max_num_seqs=3, max_num_batched_tokens=chunk)
    fast, _, steps = _run(tiny_v4_ckpt, prompts, decode_kernels=True, **kw)
    slow, _, _ = _run(tiny_v4_ckpt, prompts, decode_kernels=False, **kw)
    assert steps and fast == slow


def test_fp8_kv_cache(tiny_v4_ckpt):
    prompts = _prompts([30, 12])
    ref, ref_logits, _ = _run(tiny_v4_ckpt, prompts)
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, kv_cache_dtype="fp8_e4m3"),
                                       progress=False)
    assert engine.runner.kv.global_kv.dtype == torch.float8_e4m3fn
    assert engine.runner.kv.index_keys.dtype == torch.float8_e4m3fn  # the indexer's keys too
    plain = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4), progress=False)
    assert engine.runner.kv.global_kv.nbytes == plain.runner.kv.global_kv.numel()  # one byte per element
    out, fp8_logits, steps = _run(tiny_v4_ckpt, prompts, kv_cache_dtype="fp8_e4m3")
    assert steps and all(len(o) == GREEDY.max_tokens for o in out)
    # E4M3 keeps ~3 mantissa bits: the first step's logits move, but only a little.
    err = (fp8_logits[0] - ref_logits[0]).abs().max() / ref_logits[0].abs().max()
    assert 0 < err < 0.1


@pytest.mark.parametrize("kv_dtype,index_dtype,latent_fp8,index_fp8", [
    ("auto", "fp8_e4m3", False, True), ("fp8_e4m3", "auto", True, False), ("fp8_e4m3", None, True, True)])
def test_index_cache_dtype_apart_from_the_latent_kv(tiny_v4_ckpt, kv_dtype, index_dtype, latent_fp8, index_fp8):
    """index_cache_dtype stores the indexer's keys as FP8 (or in the model dtype) whatever the
    latent KV's dtype; None follows kv_cache_dtype. The decode kernels' path and the padded one
    pick the same tokens either way."""
    cfg = dict(kv_cache_dtype=kv_dtype, index_cache_dtype=index_dtype)
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, **cfg), progress=False)
    kv = engine.runner.kv
    assert (kv.global_kv.dtype == torch.float8_e4m3fn) == latent_fp8 and (kv.kv_scale is not None) == latent_fp8
    assert (kv.index_keys.dtype == torch.float8_e4m3fn) == index_fp8 and (kv.index_scale is not None) == index_fp8
    prompts = _prompts([30, 45, 12])  # 30+ tokens: the indexer picks the top-k (tiny-v4 keeps 16)
    fast, _, steps = _run(tiny_v4_ckpt, prompts, decode_kernels=True, **cfg)
    slow, _, _ = _run(tiny_v4_ckpt, prompts, decode_kernels=False, **cfg)
    assert steps and fast == slow


def test_index_cache_dtype_rejects_unknown_values():
    with pytest.raises(ValidationError, match="index_cache_dtype"):
        EngineConfig(index_cache_dtype="fp4")


@pytest.mark.parametrize("kv_dtype,index_dtype", [("auto", None), ("fp8_e4m3", None), ("auto", "fp8_e4m3")])
def test_engine_with_triton_kernels_interpreted(tiny_v4_ckpt, kv_dtype, index_dtype):
    """The same comparison with the Triton kernels themselves (interpreted on CPU): the
    interpreter has to be chosen before triton is imported, so this runs in a fresh process.
    With FP8 index keys alone the latent kernel quantises them as it writes them."""
    code = textwrap.dedent(f"""
        import torch
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling import SamplingParams
        import engine.moe, wideep_kernels.mla_decode, wideep_kernels.indexer, wideep_kernels.routing, wideep_kernels.swiglu, wideep_kernels.latent
        calls = {{}}
        for mod, name in [(wideep_kernels.mla_decode, "mla_decode_triton"), (wideep_kernels.indexer, "indexer_topk_triton"),
                          (wideep_kernels.routing, "route_triton"), (engine.moe, "gate_parts_triton"),
                          (wideep_kernels.swiglu, "silu_mul_triton"), (wideep_kernels.latent, "latent_triton")]:
            fn = getattr(mod, name)
            def wrapped(*a, _fn=fn, _n=name, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _fn(*a, **k)
            setattr(mod, name, wrapped)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(4, 500, (n,), generator=g).tolist() for n in (30, 5)]
        p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outs = {{}}
        for fast in (True, False):
            e = LLMEngine.from_pretrained({str(tiny_v4_ckpt)!r}, EngineConfig(block_size=4, decode_kernels=fast,
                                          kv_cache_dtype={kv_dtype!r}, index_cache_dtype={index_dtype!r}),
                                          progress=False)
            outs[fast] = [o.output_token_ids for o in e.generate(prompts, p)]
        assert outs[True] == outs[False], outs
        assert set(calls) == {{"mla_decode_triton", "indexer_topk_triton", "route_triton", "gate_parts_triton",
                              "silu_mul_triton", "latent_triton"}}, calls
        print("OK", calls)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", WIDEEP_CPU_KERNELS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kv_dtype,index_dtype", [("auto", None), ("fp8_e4m3", None), ("auto", "fp8_e4m3")])
def test_cuda_graphs_and_triton_kernels_on_gpu(tiny_v4_ckpt, kv_dtype, index_dtype):
    """On the GPU: CUDA-graph replay of the Triton decode path against the eager padded path,
    with batches that pad up to a captured size and contexts that cross a block-table bucket."""
    prompts = _prompts([3, 30, 45, 1, 70])
    kw = dict(device="cuda", kv_cache_dtype=kv_dtype, index_cache_dtype=index_dtype)
    fast, fast_logits, steps = _run(tiny_v4_ckpt, prompts, cuda_graphs=True, **kw)
    slow, slow_logits, _ = _run(tiny_v4_ckpt, prompts, decode_kernels=False, cuda_graphs=False, **kw)
    assert fast == slow
    for a, b in zip(fast_logits, slow_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, **kw), progress=False)
    engine.generate(prompts, GREEDY)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # graphs were captured and used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decode_batches_past_64_replay_from_graphs_by_default(tiny_v4_ckpt):
    """A server with max_num_seqs past 64 decodes from graphs at its full batch (padded to a
    multiple of 16), with the eager padded path's tokens."""
    prompts = _prompts([3 + (7 * i) % 40 for i in range(100)], seed=1)
    kw = dict(device="cuda", max_num_seqs=128, num_blocks=4096, warmup=False)
    fast, _, _ = _run(tiny_v4_ckpt, prompts, **kw)
    slow, _, _ = _run(tiny_v4_ckpt, prompts, decode_kernels=False, cuda_graphs=False, **kw)
    assert fast == slow
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, **kw), progress=False)
    assert engine.runner.graphs.covers(128)
    engine.generate(prompts, GREEDY)
    assert any(key[:2] == ("decode", 112) for key in engine.runner.graphs.graphs), list(engine.runner.graphs.graphs)


def test_decode_graph_sizes():
    """Decode graphs up to the default's 256 sequences, in steps of 16 past 16, and never past
    max_num_seqs."""
    from engine.cuda_graphs import _batch_sizes
    assert _batch_sizes(EngineConfig().cuda_graph_max_batch)[-3:] == [224, 240, 256]
    assert _batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_side_stream_branches_and_fused_shared_expert_in_decode_graphs(tiny_v4_ckpt, monkeypatch):
    """Graphs captured with the indexer (and, unfused, the shared experts) on a second stream, and
    with the shared expert fused into the MoE kernels, compute what one stream and a separate
    shared MLP compute; and the captures really forked."""
    from engine import streams
    forks = []
    real = streams.side_stream
    monkeypatch.setattr(streams, "side_stream", lambda device: forks.append(device) or real(device))
    prompts = _prompts([3, 30, 45, 1, 70])
    base, base_logits, _ = _run(tiny_v4_ckpt, prompts, device="cuda", decode_overlap=False, fuse_shared_experts=False)
    assert not forks
    for kw in (dict(fuse_shared_experts=False), dict(decode_overlap=False), {}):
        forks.clear()
        out, logits, _ = _run(tiny_v4_ckpt, prompts, device="cuda", **kw)
        assert bool(forks) == kw.get("decode_overlap", True), kw
        assert out == base, kw
        for a, b in zip(logits, base_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_block_table_array_follows_growth_and_replacement():
    from engine.model_runner import _table_array
    from engine.sequence import Sequence
    seq = Sequence("r", [1, 2, 3], GREEDY)
    seq.block_table = [5, 9]
    assert _table_array(seq).tolist() == [5, 9]
    seq.block_table.append(2)  # grows in place: extended, not rebuilt
    assert _table_array(seq).tolist() == [5, 9, 2]
    seq.block_table = [7]  # replaced (preemption, prefix hit): rebuilt
    assert _table_array(seq).tolist() == [7]
    seq.block_table = [1, 4]
    assert _table_array(seq).tolist() == [1, 4]


def test_warmup_leaves_nothing_behind(tiny_v4_ckpt):
    """On GPU the engine warms up at start; the same routine on CPU must leave no request,
    used block, statistic or load count behind, and not change what a request computes."""
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4), progress=False)
    prompts = _prompts([30, 5])
    before = [o.output_token_ids for o in engine.generate(prompts, GREEDY)]
    fresh = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4), progress=False)
    fresh.warmup()
    stats = fresh.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["steps"] == 0 and stats["prefix_hit_tokens"] == 0 and not fresh.requests
    assert all(int(m.slot_load.sum()) == 0 for m in fresh.runner.model.moe_layers())
    assert [o.output_token_ids for o in fresh.generate(prompts, GREEDY)] == before


def test_graph_block_buckets_waste_at_most_a_quarter():
    from engine.cuda_graphs import blocks_bucket
    assert [blocks_bucket(n) for n in (1, 16, 17, 129, 8193)] == [16, 16, 20, 160, 10240]
    widths = [blocks_bucket(n) for n in range(1, 1 << 14)]
    assert all(w >= n and (n <= 16 or w <= 1.25 * n) for n, w in zip(range(1, 1 << 14), widths))
    assert len(set(widths)) <= 4 * 10 + 1  # four per octave from 16 to 16K blocks


def test_short_contexts_share_one_graph_width():
    """Every table up to the dense-attention limit (index_topk + window - 1 tokens) pads to one
    graph width; past it, four widths an octave as before. cuda_graph_min_tokens moves it."""
    from types import SimpleNamespace
    from engine.config import preset
    from engine.cuda_graphs import DecodeGraphs, min_graph_blocks
    bench = preset("bench")  # index_topk 2048, window 128
    assert min_graph_blocks(EngineConfig(), bench, 1 << 20) == 136  # 2175 tokens, blocks of 16
    assert min_graph_blocks(EngineConfig(block_size=64), bench, 1 << 20) == 34
    assert min_graph_blocks(EngineConfig(), bench, 1000) == 63  # never past the longest context
    assert min_graph_blocks(EngineConfig(), preset("tiny"), 1 << 20) == 128  # no indexer: 2048 tokens
    assert min_graph_blocks(EngineConfig(cuda_graph_min_tokens=0), bench, 1 << 20) == 16
    assert min_graph_blocks(EngineConfig(cuda_graph_min_tokens=5000), bench, 1 << 20) == 313
    graphs = SimpleNamespace(min_blocks=136)
    assert {DecodeGraphs._blocks_bucket(graphs, n) for n in range(1, 137)} == {136}
    assert [DecodeGraphs._blocks_bucket(graphs, n) for n in (137, 161, 8193)] == [160, 192, 10240]
    graphs.min_blocks = 16
    assert [DecodeGraphs._blocks_bucket(graphs, n) for n in (1, 17, 129)] == [16, 20, 160]
    with pytest.raises(ValidationError, match="cuda_graph_min_tokens"):
        EngineConfig(cuda_graph_min_tokens=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_short_context_graphs_are_captured_at_start_and_shared(tiny_v4_ckpt):
    """Warm-up captures every batch size's decode and chunk graph of the shared width; contexts
    below it (dense, and sparse ones: tiny-v4 keeps 16 keys, and the width was raised past its
    dense contexts) replay graphs of that width alone, all captured at start, with the tokens of
    a graph per width."""
    prompts = _prompts([3, 30, 45, 1, 70])  # up to 80 tokens: tables of 20 blocks of 4
    kw = dict(device="cuda", max_num_seqs=8)
    per_width, per_logits, _ = _run(tiny_v4_ckpt, prompts, cuda_graph_min_tokens=0, **kw)
    shared, shared_logits, _ = _run(tiny_v4_ckpt, prompts, cuda_graph_min_tokens=96, **kw)
    assert shared == per_width
    for a, b in zip(shared_logits, per_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, cuda_graph_min_tokens=96, **kw),
                                       progress=False)
    g = engine.runner.graphs
    assert g.min_blocks == 24
    at_start = set(g.graphs)
    for sparse in (False, True):
        assert {("decode", rows, 24, sparse) for rows in g.sizes} <= at_start, at_start
        assert {("chunk", rows, 24, sparse) for rows in g.chunk_sizes} <= at_start, at_start
    engine.generate(prompts, GREEDY)
    assert set(g.graphs) == at_start and any(key[3] for key in g.graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_later_widths_are_captured_without_an_eager_run_first(tiny_v4_ckpt, monkeypatch):
    """The first capture of a (form, rows, sparse) runs the step eagerly first; another width of
    it does not, and gives the tokens and logits of the path without graphs (all graphs writing
    their logits into one buffer). A capture that fails without the eager run is tried again with
    it, and kept."""
    from engine.cuda_graphs import DecodeGraphs
    calls, fail_next = [], []
    capture = DecodeGraphs._capture

    def recorded(self, *args, eager_first=True):
        calls.append(eager_first)
        if fail_next and not eager_first:
            fail_next.pop()
            raise RuntimeError("made to fail")
        return capture(self, *args, eager_first=eager_first)
    monkeypatch.setattr(DecodeGraphs, "_capture", recorded)
    prompts = _prompts([3, 40])  # the longer decodes from 40 to 100 tokens: tables of 16 to 28 blocks of 4
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", max_num_seqs=8, warmup=False, cuda_graph_min_tokens=0, max_num_batched_tokens=512)

    def run(engine):
        logits, sample = [], engine.runner.sample
        engine.runner.sample = lambda seqs, lg: logits.append(lg.clone()) or sample(seqs, lg)
        return [o.output_token_ids for o in engine.generate(prompts, params)], logits
    plain, plain_logits = run(LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, cuda_graphs=False,
                                                                                   **kw), progress=False))
    calls.clear()
    engine = LLMEngine.from_pretrained(tiny_v4_ckpt, EngineConfig(block_size=4, **kw), progress=False)
    tokens, logits = run(engine)
    assert tokens == plain
    for a, b in zip(logits, plain_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    g = engine.runner.graphs
    kinds = {(k[0], k[1], k[3]) for k in g.graphs}
    assert len(g.graphs) > len(kinds) and not g.failed  # several widths of some (form, rows, sparse)
    assert calls.count(True) == len(kinds) and calls.count(False) == len(g.graphs) - len(kinds)
    # every graph writes its logits into the one shared buffer rather than keeping its own
    assert all(lg.data_ptr() == g.logits.data_ptr() for _, _, lg in g.graphs.values())
    # a capture without the eager run that fails: once more with it, and kept
    calls.clear()
    fail_next.append(True)
    key = next(k for k in g.graphs if k[0] == "decode")
    del g.graphs[key]
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == plain
    assert not fail_next and key in g.graphs and not g.failed
    assert any(calls[i:i + 2] == [False, True] for i in range(len(calls)))


def test_pdl_launches_are_plain_off_the_gpu(monkeypatch):
    from wideep_kernels import pdl
    monkeypatch.setattr(pdl, "MODE", pdl.MODES["early"])
    assert pdl.pdl_launch(torch.zeros(1)) == {}


def test_pdl_mode_is_checked_at_import():
    env = dict(os.environ, WIDEEP_PDL="sometimes")
    r = subprocess.run([sys.executable, "-c", "import wideep_kernels.pdl"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode != 0 and "WIDEEP_PDL" in r.stderr and "early" in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["wait", "early"])
def test_decode_graphs_with_dependent_launches_match_plain_ones(tiny_v4_ckpt, monkeypatch, mode):
    """Programmatic dependent launch (wideep_kernels/pdl.py) in captured decode graphs, with the indexer on
    a side stream and the shared expert fused: the same tokens and logits as plain launches."""
    from wideep_kernels import pdl
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    prompts = _prompts([3, 30, 45, 1, 70])
    monkeypatch.setattr(pdl, "MODE", 0)
    base, base_logits, _ = _run(tiny_v4_ckpt, prompts, device="cuda", cuda_graphs=True)
    monkeypatch.setattr(pdl, "MODE", pdl.MODES[mode])
    assert pdl.pdl_launch(torch.zeros(1, device="cuda")) == {"PDL": pdl.MODES[mode], "launch_pdl": True}
    out, logits, _ = _run(tiny_v4_ckpt, prompts, device="cuda", cuda_graphs=True)
    assert out == base
    for a, b in zip(logits, base_logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
