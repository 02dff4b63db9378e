"""Expert-parallel steps of fixed shape: the group's agreement on each step, the choice between
replaying a decode graph and running eagerly on every rank, expert maps updated in place, and
(GPU) decode graphs with the MoE collectives inside them."""
import contextlib
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import ep as ep_module
from engine.cuda_graphs import DecodeGraphs
from engine.ep import ExpertParallel, GroupStep, initial_placement
from engine.ep_step import run_lockstep
from engine.host_agreement import host_exchange
from engine.moe import ExpertMap


def test_expert_map_takes_a_new_placement_in_place():
    m = ExpertMap(torch.tensor([0, 1, 2, 3, 0, 1]), 4, max_replicas=3)
    tensors = (m.phys2log, m.num_replicas, m.log2phys)
    assert m.log2phys.shape == (4, 3)
    m.update_(torch.tensor([3, 3, 3, 0, 1, 2]))  # expert 3 in three slots now
    assert all(a is b for a, b in zip(tensors, (m.phys2log, m.num_replicas, m.log2phys)))
    assert m.num_replicas.tolist() == [1, 1, 1, 3]
    assert m.log2phys[3].tolist() == [0, 1, 2]
    # three tokens of expert 3 spread over its three slots, as a fresh map would send them
    ids = torch.tensor([[3], [3], [3]])
    assert m.slots_for(ids).flatten().tolist() == ExpertMap(torch.tensor([3, 3, 3, 0, 1, 2]), 4).slots_for(
        ids).flatten().tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="max_replicas"):
        ExpertMap(torch.tensor([0, 0, 0, 0, 1, 2, 3]), 4, max_replicas=3)
    with pytest.raises(ValueError, match="cannot replace"):
        m.update_(torch.tensor([0, 1, 2, 3]))


class Batch:
    def __init__(self, rows: int, tokens: int = 1, known: int = 0):
        self.seqs = [SimpleNamespace(num_computed_tokens=0, num_tokens=known)] * rows
        self.num_tokens = [tokens] * rows

    def __len__(self):
        return len(self.seqs)


class Runner:
    """ModelRunner's surface that run_lockstep uses, recording what it was asked to do."""

    def __init__(self, ep, longest: int, prompt_rows: bool = False):
        self.ep, self.longest, self.calls, self.ahead_ids = ep, longest, [], []
        self.prompt_rows = prompt_rows  # a sequence asks for its prompt's logprobs
        graphs = SimpleNamespace(sizes=[1, 2, 4, 8, 16], chunk_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                                 _blocks_bucket=lambda m: max(16, m))
        graphs.covers = lambda b: b <= 16
        graphs.group_shape = lambda *a: DecodeGraphs.group_shape(graphs, *a)
        graphs.group_chunk_shape = lambda *a: DecodeGraphs.group_chunk_shape(graphs, *a)
        graphs.run = lambda batch, longest, ahead_ids, shape: self._record("graph", len(batch), shape,
                                                                           ahead_ids=ahead_ids)
        self.graphs = graphs
        self.model = SimpleNamespace(model=SimpleNamespace(rotary=SimpleNamespace(ensure=lambda n: None)))

    def _record(self, *call, ahead_ids=None):
        self.calls.append(call + (self.ep.rows,))
        self.ahead_ids.append(ahead_ids)
        return torch.zeros(16, 4)

    def decode_length(self, batch):
        return self.longest

    def decode_width(self, batch, longest):
        return (longest - 1) // 16 + 1

    def needs_sparse(self, longest):
        return longest > 1000

    def chunk_graphs_take(self, rows):
        return rows <= 512

    def wants_prompt_rows(self, batch):
        return self.prompt_rows

    def run_chunk(self, batch, rows, shape, ahead_ids):
        self._record("chunk", len(batch), shape, ahead_ids=ahead_ids)
        return [], None

    def run_idle(self):
        self._record("idle")

    def run_eager(self, batch, longest, ahead_ids):
        self._record("eager", len(batch), ahead_ids=ahead_ids)
        return [], None


@pytest.fixture
def group_of_two():
    """Rank 0 of two, its peer's wish for the step (rows, graph, chunk, width, sparse) and whether it
    has staged a committed plan set by the test (the exchange faked)."""
    peer = {"staged": 0}

    def exchange(values):
        peer["sent"] = list(values)
        return [list(values), peer["wish"] + [peer["staged"]]]
    ep = ExpertParallel(0, 2, initial_placement(1, 4, 4), 4, exchange=SimpleNamespace(exchange=exchange))
    ep.attach([])
    return ep, peer


@pytest.mark.parametrize("mine,peer,expect,counts", [
    # (sequences, longest, tokens each) of this rank (longest 0: a prompt chunk); the peer's (rows,
    # graph, chunk, width, sparse); the call made, with the MoE rows
    ((3, 40, 1), (9, 1, 1, 200, 0), ("graph", 3, (16, 200, False), 16), [3, 9]),
    ((0, 0, 1), (5, 1, 1, 3, 1), ("graph", 0, (8, 16, True), 8), [0, 5]),        # idle: padding rows only
    ((3, 40, 1), (0, 1, 1, 0, 0), ("graph", 3, (4, 16, False), 4), [3, 0]),
    # the peer computes a prompt chunk: every rank replays a chunk graph, decodes as its rows
    ((0, 0, 1), (300, 0, 1, 0, 0), ("chunk", 0, (512, 16, False), 512), [0, 300]),
    ((3, 40, 1), (300, 0, 1, 40, 1), ("chunk", 3, (512, 40, True), 512), [3, 300]),
    ((2, 0, 100), (5, 1, 1, 3, 0), ("chunk", 2, (256, 16, False), 256), [200, 5]),  # this rank's chunk
    ((20, 40, 1), (2, 1, 1, 3, 0), ("chunk", 20, (32, 16, False), 32), [20, 2]),    # past the decode graphs
    # a chunk past the chunk graphs: every rank eager
    ((0, 0, 1), (3000, 0, 0, 0, 0), ("idle", 3000), [0, 3000]),
    ((3, 40, 1), (3000, 0, 0, 0, 0), ("eager", 3, 3000), [3, 3000]),
    ((0, 0, 1), (0, 1, 1, 0, 0), None, [0, 0]),                                    # nobody has work
])
def test_the_group_replays_one_graph_or_runs_eagerly(group_of_two, mine, peer, expect, counts):
    ep, wish = group_of_two
    wish["wish"] = list(peer)
    runner = Runner(ep, mine[1])
    done, logits = run_lockstep(runner, Batch(mine[0], mine[2]))
    assert runner.calls == ([expect] if expect else [])
    assert ep.counts.tolist() == counts
    if expect and expect[0] == "graph":
        assert done == list(range(mine[0])) and logits.shape[0] == mine[0]


def test_a_prompt_whose_logprobs_are_asked_runs_the_group_eagerly(group_of_two):
    """Only the eager forward keeps every prompt row's hidden state: a rank whose chunk needs
    them cannot replay a chunk graph, so no rank does."""
    ep, wish = group_of_two
    wish["wish"] = [5, 1, 1, 3, 0]
    runner = Runner(ep, 0, prompt_rows=True)
    run_lockstep(runner, Batch(2, 100))
    assert runner.calls == [("eager", 2, 200)]
    assert wish["sent"][2] == 0  # it told the peer it cannot take a chunk graph


@pytest.mark.parametrize("peer,expect", [
    ((2, 1, 1, 3, 0), ("graph", 3, (4, 16, False), 4)),
    ((300, 0, 1, 0, 0), ("chunk", 3, (512, 16, False), 512)),  # the peer's prompt: a chunk graph
    ((3000, 0, 0, 0, 0), ("eager", 3, 3000)),
])
def test_a_step_launched_ahead_takes_part_in_the_agreement(group_of_two, peer, expect):
    """A decode step launched ahead (async scheduling) agrees like any other, its rows and width
    one position past its sequences' known tokens, and whichever path the group picks gets its
    input tokens, which are still on the device."""
    ep, wish = group_of_two
    wish["wish"] = list(peer)
    runner = Runner(ep, 0)  # its last tokens are unknown: not a decode step by the host's count
    ids = torch.tensor([7, 8, 9])
    run_lockstep(runner, Batch(3, known=64), ahead_ids=ids)
    assert runner.calls == [expect] and runner.ahead_ids == [ids]
    # rows, graph, chunk, width (65 positions: 5 blocks of 16), sparse, staged
    assert wish["sent"] == [3, 1, 1, 5, 0, 0]
    assert ep.counts.tolist() == [3, peer[0]]


def test_one_agreement_a_step_says_who_works_and_when_to_switch(group_of_two):
    """The step's one all-gather also tells every rank whether anyone has work (an idle group
    runs no forward) and switches a committed plan only at the step where every rank has it."""
    ep, wish = group_of_two
    wish["wish"] = [0, 1, 1, 0, 0]
    assert ep.agree(0).rows == 0 and not ep.busy
    wish["wish"] = [2, 1, 1, 16, 0]
    assert ep.agree(0).rows == 2 and ep.busy
    new = torch.tensor([[3, 2, 1, 0]])
    ep.pending = ep_module.Migration("p", new, committed=True)
    ep.pending.done.set()
    ep.agree(1)  # staged here, not yet on the peer
    assert ep.switches == 0 and ep.phys2log.tolist() == [[0, 1, 2, 3]]
    wish["staged"] = 1
    ep.agree(1)
    assert ep.switches == 1 and ep.phys2log.tolist() == new.tolist() and ep.pending is None
    assert ep.maps[0].log2phys[:, 0].tolist() == [3, 2, 1, 0]


def test_real_rows_mask_is_filled_in_place_each_step(group_of_two):
    """Up to the reserved rows the mask of real gathered rows lives in one buffer (decode graphs
    read it in place), refilled for every step's counts and padding; past them there is none
    and the MoE layers make their own."""
    ep, wish = group_of_two
    ep.reserve(8)
    wish["wish"] = [3, 1, 1, 0, 0]
    ep.agree(2)
    first = ep.real
    assert first.flatten().tolist() == [True, True, False, True, True, True]
    ep.set_rows(4)  # padded to a graph's rows
    assert ep.real.flatten().tolist() == [True, True, False, False] + [True, True, True, False]
    assert ep.real.data_ptr() == first.data_ptr()
    wish["wish"] = [20, 0, 0, 0, 0]
    ep.agree(1)
    assert ep.rows == 20 and ep.real is None


def test_moe_rows_past_the_agreement_are_refused(group_of_two):
    ep, wish = group_of_two
    wish["wish"] = [2, 0, 0, 0, 0]
    ep.agree(2)
    with pytest.raises(RuntimeError, match="more than the 2 the group agreed on"):
        ep.moe_forward(None, torch.zeros(3, 8))


# ---------------------------------------------------------------- GPU

def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def staggered(engine, prompts, params, every=3):
    """Greedy outputs of the prompts, one added every `every` steps while the others decode."""
    waiting, final, step = list(enumerate(prompts)), {}, 0
    while waiting or engine.has_unfinished_requests():
        if waiting and step % every == 0:
            i, prompt = waiting.pop(0)
            engine.add_request(f"staggered-{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        step += 1
    return [final[f"staggered-{i}"] for i in range(len(prompts))]


class NoDecodeGraphPeer:
    """A host exchange whose group has a rank that cannot replay decode graphs: every step takes
    a chunk graph, steps launched ahead too (their input ids written into the chunk graph's)."""

    def __init__(self, exchange):
        self.inner = exchange

    def exchange(self, values):
        return self.inner.exchange([values[0], 0] + list(values[2:]))


def _one_rank_group(cfg, slots: int, host_agreement: bool, no_decode_graphs: bool = False) -> ExpertParallel:
    """The ExpertParallel of a one-rank NCCL group (the process group already made)."""
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    exchange = host_exchange(0, 1, GroupStep.WIDTH, dist.new_group(backend="gloo")) if host_agreement else None
    if no_decode_graphs:
        exchange = NoDecodeGraphPeer(exchange)
    return ExpertParallel(0, 1, initial_placement(layers, cfg.n_routed_experts, slots), cfg.n_routed_experts,
                          group=dist.group.WORLD, migrate_group=dist.new_group(backend="gloo"), exchange=exchange)


@contextlib.contextmanager
def _one_rank_engine(ckpt, engine_cfg):
    """An engine on a one-rank NCCL group agreeing on the host, and its ExpertParallel; the
    process group is torn down after."""
    from engine.checkpoint import load_model
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    cfg = ModelConfig.from_file(ckpt)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    try:
        ep = _one_rank_group(cfg, cfg.n_routed_experts, host_agreement=True)
        model = load_model(ckpt, progress=False, local_phys2log=ep.local_phys2log(), device="cuda")
        yield LLMEngine(model, Tokenizer(ckpt), engine_cfg, ep=ep), ep
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
@pytest.mark.parametrize("agreement", ["nccl", "host", "host, chunk graphs only"])
def test_gpu_decode_graphs_with_the_moe_collectives(tiny_ckpt, agreement):
    """One NCCL rank: decode steps are captured with the all-gather and reduce-scatter inside,
    give the tokens of the engine without expert parallelism, and a live re-placement (weights
    and maps copied in place) leaves the captured graphs valid: same tokens, nothing re-captured.
    With the agreement on the host the engine runs decode steps ahead (async scheduling), with
    the same tokens, through decode graphs or, when the group cannot replay those, through chunk
    graphs; over NCCL it cannot run ahead."""
    from engine.checkpoint import load_model
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer

    cfg = ModelConfig.from_file(tiny_ckpt)
    engine_cfg = EngineConfig(device="cuda", dtype="float32", block_size=4, warmup=False)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 17, 40 + 3 * i, 9] * (i + 1) for i in range(3)]
    plain = LLMEngine.from_pretrained(tiny_ckpt, engine_cfg, progress=False)
    want = [o.output_token_ids for o in plain.generate(prompts, greedy)]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    try:
        layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        slots = cfg.n_routed_experts + 2
        host_agreement = agreement != "nccl"
        ep = _one_rank_group(cfg, slots, host_agreement, no_decode_graphs=agreement == "host, chunk graphs only")
        model = load_model(tiny_ckpt, progress=False, local_phys2log=ep.local_phys2log(), device="cuda")
        engine = LLMEngine(model, Tokenizer(tiny_ckpt), engine_cfg, ep=ep)
        assert engine._run_ahead == host_agreement
        ahead, run_ahead = [], engine.runner.run_ahead
        engine.runner.run_ahead = lambda batch, ids: ahead.append(len(batch)) or run_ahead(batch, ids)
        ep.share_weights()
        got = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        assert got == want
        captured = dict(engine.runner.graphs.graphs)
        forms = {key[0] for key in captured}
        assert forms == ({"chunk"} if "only" in agreement else {"decode", "chunk"}) and not engine.runner.graphs.failed
        # every expert to another slot, two of them twice
        new = torch.stack([torch.roll(torch.arange(slots) % cfg.n_routed_experts, 3) for _ in range(layers)])
        ep.stage("p", new)
        for _ in range(1000):  # the copies are enqueued at step boundaries (agree), idle ones too
            engine.step()
            if ep.pending.done.is_set():
                break
        assert ep.wait_staged("p", 10)["staged"]
        ep.commit("p")
        engine.step()
        assert ep.switches == 1 and ep.phys2log.tolist() == new.tolist()
        again = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        assert again == want
        assert all(engine.runner.graphs.graphs[key] is captured[key] for key in captured)
        # Prompts arriving while others decode: those steps replay chunk graphs (the decodes as
        # rows of them) instead of running eagerly, with the same tokens.
        eager = []
        engine.runner.run_eager = lambda *a: eager.append(a)  # must not be called
        assert staggered(engine, prompts, greedy) == want
        assert eager == [] and any(key[0] == "chunk" for key in engine.runner.graphs.graphs)
        assert (len(ahead) > 10) == host_agreement
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_gpu_rank_warms_up_with_its_group(tiny_v4_ckpt):
    """An expert-parallel rank warms up at start like a lone engine: the graphs of every batch
    size at the shared width, captured with the MoE collectives inside, are there before the
    first request, which then captures none of them and gets the lone engine's tokens."""
    engine_cfg = EngineConfig(device="cuda", dtype="float32", block_size=4, cuda_graph_max_batch=16,
                              cuda_graph_max_chunk=64)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 17, 40 + 3 * i, 9] * (i + 1) for i in range(3)]
    plain = LLMEngine.from_pretrained(tiny_v4_ckpt, engine_cfg.model_copy(update={"warmup": False}), progress=False)
    want = [o.output_token_ids for o in plain.generate(prompts, greedy)]
    with _one_rank_engine(tiny_v4_ckpt, engine_cfg) as (engine, _):
        graphs = engine.runner.graphs
        shared = {("decode", rows, graphs.min_blocks, False) for rows in graphs.sizes} | {
            ("chunk", rows, graphs.min_blocks, False) for rows in graphs.chunk_sizes}
        assert shared <= set(graphs.graphs) and not graphs.failed
        assert engine.stats()["steps"] == 0 and engine.stats()["kv_blocks_used"] == 0
        before = dict(graphs.graphs)
        assert [o.output_token_ids for o in engine.generate(prompts, greedy)] == want
        assert all(graphs.graphs[key] is before[key] for key in shared)
        assert {key for key in graphs.graphs if key not in before and not key[3]} == set()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")
def test_gpu_rank_captures_ahead_when_its_group_is_idle(tiny_v4_ckpt):
    """A rank whose group stays idle (steps with no work, as its serving loop takes them) captures
    ahead, with the MoE collectives inside, the next width of each shape served; requests that
    then grow into it capture no decode graph and get the lone engine's tokens."""
    engine_cfg = EngineConfig(device="cuda", dtype="float32", block_size=4, cuda_graph_max_batch=16,
                              cuda_graph_max_chunk=64, warmup=False, cuda_graph_min_tokens=16,
                              cuda_graph_ahead_idle_s=0.05)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    short = [[5 + i, 17, 40 + 3 * i, 9] * 10 for i in range(2)]   # 40 -> 52 tokens: tables of 16 blocks
    longer = [[7 + i, 21, 30 + 5 * i, 11] * 15 for i in range(2)]  # 60 -> 72 tokens: 16, then 20 blocks
    plain = LLMEngine.from_pretrained(tiny_v4_ckpt, engine_cfg.model_copy(update={"cuda_graphs": False}),
                                      progress=False)
    want = [o.output_token_ids for o in plain.generate(longer, greedy)]
    with _one_rank_engine(tiny_v4_ckpt, engine_cfg) as (engine, ep):
        graphs = engine.runner.graphs
        engine.generate(short, greedy)
        assert graphs.widest[("decode", 2)] == (16, True)
        for _ in range(200):  # the serving loop's idle turns: a step, then housekeeping
            engine.step()
            assert not ep.busy
            engine.housekeeping()
            if graphs.captures_ahead and not graphs.ahead_shapes():
                break
        assert ("decode", 2, 20, True) in graphs.graphs and not graphs.failed
        before = set(graphs.graphs)
        assert [o.output_token_ids for o in engine.generate(longer, greedy)] == want
        assert [key for key in graphs.graphs if key not in before and key[0] == "decode"] == []
