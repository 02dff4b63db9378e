"""Body of one expert-parallel rank for tests/test_ep.py (run in a spawned process)."""
import asyncio
import contextlib
import datetime
import os
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from engine import AsyncLLMEngine, EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import EngineDeadError
from engine.cuda_graphs import DecodeGraphs
from engine.ep import ExpertParallel, GroupStep, PlanError, initial_placement
from engine.host_agreement import host_exchange

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def prompts_for(rank, salt=0):
    g = torch.Generator().manual_seed(100 + rank + 1000 * salt)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in ((30, 7) if rank == 0 else (18,))]


class EagerGroupGraphs(DecodeGraphs):
    """DecodeGraphs whose graphs run eagerly (CPU): each step takes the decode or chunk graph path
    and shape the group chose, with the same inputs, and the key it would replay is recorded."""

    def __init__(self, runner, max_batch):
        super().__init__(runner, max_batch)
        self.keys = []
        self.ahead = []  # the keys of steps launched ahead (their input ids written on the device)
        self.prepared = []  # the keys of captures with no request waiting (capture_short, capture_ahead)

    def _host_buffer(self, nbytes):
        self.staging_host = np.zeros(nbytes, dtype=np.uint8)
        return self.staging_host

    def _replay(self, key, nbytes, fill, forward, keep=None):
        self.keys.append(key)
        self.graphs[key] = None  # captured, as far as capture_ahead is concerned
        if self._preparing:
            self.prepared.append(key)
        if fill is not None:
            self.ahead.append(key)
        static = torch.from_numpy(self.staging_host[:nbytes].copy())
        if fill is not None:
            fill(static)
        return forward(static)


def setup(rank, world, port, ckpt, fp8=False, serving_loop=True, shm=False, **engine_kw):
    """The rank's engine, stepped by an AsyncLLMEngine's loop unless serving_loop is off; shm:
    the ranks agree on each step through shared memory (as GPU ranks of one host do) rather than
    over the gloo group."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    migrate = dist.new_group(backend="gloo")
    exchange = host_exchange(rank, world, GroupStep.WIDTH, dist.new_group(backend="gloo")) if shm else None
    engine = LLMEngine(*_model_and_tok(ckpt, rank, world, migrate, fp8, exchange, **engine_kw))
    return AsyncLLMEngine(engine) if serving_loop else SimpleNamespace(engine=engine, shutdown=lambda: None)


def engine_config(fp8=False, **engine_kw):
    # No graphs captured ahead while idle unless a scenario asks: the ranks' recorded keys would
    # depend on when each reads them.
    engine_kw = dict(dict(cuda_graph_ahead_idle_s=None), **engine_kw)
    return EngineConfig(block_size=4, expert_dtype="fp8_e4m3" if fp8 else "auto", **engine_kw)


def slot0(moe):
    """Slot 0's gate/up weights, and with FP8 experts their scales (plain floats: fp8 is exact in fp32)."""
    return moe.w13.data[0].float().clone(), None if moe.scales is None else moe.scales.w13[0].clone()


def _model_and_tok(ckpt, rank, world, migrate, fp8=False, exchange=None, **engine_kw):
    from engine.checkpoint import load_model
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer
    cfg = ModelConfig.from_file(ckpt)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    ep = ExpertParallel(rank, world, initial_placement(moe_layers, cfg.n_routed_experts, cfg.n_routed_experts),
                        cfg.n_routed_experts, group=dist.group.WORLD, migrate_group=migrate, exchange=exchange)
    model = load_model(ckpt, progress=False, local_phys2log=ep.local_phys2log())
    return model, Tokenizer(ckpt), engine_config(fp8, **engine_kw), ep


async def generate_all(aengine, prompts, tag):
    async def one(i, p):
        tokens = []
        async for out in aengine.generate(f"{tag}-{i}", p, GREEDY):
            tokens += out.new_token_ids
        return tokens
    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run(rank, world, port, ckpt, results, scenario):
    # "migrate_fp8": the same migration with block-FP8 experts (their scales travel with them)
    if scenario == "kernels":  # the Triton kernels (interpreted) in place of the torch references
        os.environ["WIDEEP_CPU_KERNELS"] = "1"
    # "ahead_shm": the "ahead" scenario with the agreement through shared memory
    ahead = scenario in ("ahead", "ahead_shm")
    # "capture_ahead": graphs from 64 tokens on, captured ahead after 10 idle steps; a prefix hit's
    # window replayed exactly, so that a request's tokens are the same the second time
    engine_kw = (dict(cuda_graph_min_tokens=16, cuda_graph_ahead_idle_s=0.05, replay_mode="exact")
                 if scenario == "capture_ahead" else {})
    aengine = setup(rank, world, port, ckpt, fp8=scenario == "migrate_fp8",
                    serving_loop=not ahead and scenario != "warmup", shm=scenario == "ahead_shm", **engine_kw)
    engine, ep = aengine.engine, aengine.engine.ep
    out = {"rank": rank}
    try:
        prompts = prompts_for(rank)
        if scenario == "graphs":
            graphs_scenario(aengine, engine, ep, prompts, out)
            return
        if scenario == "warmup":
            warmup_scenario(engine, ep, prompts, out)
            return
        if scenario == "capture_ahead":
            capture_ahead_scenario(aengine, engine, ep, prompts, out)
            return
        if ahead:  # the engine is stepped here, not by a serving loop
            out["exchange"] = type(ep.exchange).__name__
            ahead_scenario(engine, ep, out)
            return
        moe = engine.runner.model.moe_layers()[0]
        out["shared_fused"] = moe._shared_slot(moe.w13.new_zeros(1, moe.w13.shape[-1])) is not None
        out["before"] = asyncio.run(generate_all(aengine, prompts, "before"))
        # Both ranks done: no forward of the other's still counting here (its idle forwards would).
        dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
        out["load_before"] = ep.take_load().sum(dim=1)  # pairs this rank computed, per MoE layer
        if scenario == "kernels":
            return
        # Rank 0 alone decodes while rank 1 has nothing: rank 1's engine still steps with it
        # (idle forwards that run the MoE layers' collectives).
        steps0 = engine.num_steps
        # both ranks have counted before rank 0's request starts (its forwards count on both)
        dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
        out["solo"] = asyncio.run(generate_all(aengine, prompts[:1] if rank == 0 else [], "solo"))
        dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
        out["solo_steps"] = engine.num_steps - steps0
        moe = engine.runner.model.moe_layers()[0]
        out["slot0_before"], out["slot0_scale_before"] = slot0(moe)
        # Move every expert to the other rank: all of them must travel.
        spr = ep.spr
        new = torch.cat([ep.phys2log[:, spr:], ep.phys2log[:, :spr]], dim=1)
        for bad in (new[:, :3], torch.zeros_like(new)):
            try:
                ep.stage("bad", bad)
                out.setdefault("refused", []).append("accepted")
            except PlanError as e:
                out.setdefault("refused", []).append(str(e))
        if scenario == "kill" and rank == 1:
            ep.stage("p1", new, delay_s=0.5)
            time.sleep(0.1)
            os._exit(0)  # dies mid-migration
        ep.stage("p1", new, delay_s=1.0)  # deliberately slow staging
        if scenario == "kill":  # rank 0: its peer dies before the copies start
            survive_peer_loss(aengine, ep, moe, prompts, out)
            return

        async def decode_while_staging():
            long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
            task = asyncio.ensure_future(_drain(aengine.generate("long", prompts[0], long)))
            await asyncio.sleep(0.05)
            steps0 = engine.num_steps
            staged = await asyncio.to_thread(ep.wait_staged, "p1", 30)
            steps_during = engine.num_steps - steps0
            await task
            return staged, steps_during
        staged, steps_during = asyncio.run(decode_while_staging())
        out["staged"], out["steps_during_staging"] = staged, steps_during
        if not staged["staged"]:
            ep.abort("p1")
            out["phys2log_after"] = ep.phys2log.clone()
            out["slot0_after"], out["slot0_scale_after"] = slot0(moe)
            return
        ep.commit("p1")
        deadline = time.monotonic() + 20
        while ep.switches == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        out["switched"] = ep.switches
        out["phys2log_after"] = ep.phys2log.clone()
        out["slot0_after"], out["slot0_scale_after"] = slot0(moe)
        out["after"] = asyncio.run(generate_all(aengine, prompts, "after"))
    except BaseException as e:
        out["error"] = repr(e)
    finally:
        # plain lists: tensors would travel as shared memory that dies with this process
        results.put({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
        if scenario != "kill":
            # The engines keep stepping in lockstep (idle) until both ranks are done: a rank that
            # left first would fail its peer's next collective.
            with contextlib.suppress(RuntimeError):
                dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
            aengine.shutdown()
            dist.destroy_process_group()


def graphs_scenario(aengine, engine, ep, prompts, out):
    """The group's choice of graph over steps where prompts arrive while others decode, each
    rank's prompts at other times: every step's graph (run eagerly) is recorded."""
    with aengine._lock:
        graphs = engine.runner.graphs = EagerGroupGraphs(engine.runner, 4)
        ep.reserve(max(graphs.sizes[-1], graphs.chunk_sizes[-1]))
        eager = []
        engine.runner.run_eager = lambda *a: eager.append(len(a[0])) or ([], None)

    async def arrive(i, p):
        await asyncio.sleep(0.15 * i + 0.1 * ep.rank)
        tokens = []
        async for o in aengine.generate(f"graphs-{i}", p, GREEDY):
            tokens += o.new_token_ids
        return tokens

    async def all_of_them():
        return await asyncio.gather(*(arrive(i, p) for i, p in enumerate(prompts)))
    out["tokens"] = asyncio.run(all_of_them())
    dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
    out["keys"] = [list(k) for k in graphs.keys]
    out["eager"] = eager


def capture_ahead_scenario(aengine, engine, ep, prompts, out):
    """Serving, then idle: each rank's loop captures ahead (graphs run eagerly, keys recorded) the
    next width of each shape served, both at the same step, or their forwards' collectives would
    not meet; then serving again, the same tokens."""
    with aengine._lock:
        graphs = engine.runner.graphs = EagerGroupGraphs(engine.runner, 4)
        ep.reserve(max(graphs.sizes[-1], graphs.chunk_sizes[-1]))
    out["tokens"] = asyncio.run(generate_all(aengine, prompts, "first"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (aengine.run_locked(lambda e: e.runner.graphs.ahead_shapes())
                                           or not graphs.prepared):
        time.sleep(0.02)
    with aengine._lock:
        out["widest"] = sorted([*k, *v] for k, v in graphs.widest.items())
        out["prepared"] = [list(k) for k in graphs.prepared]
        out["stats"] = engine.stats()
    dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))
    out["again"] = asyncio.run(generate_all(aengine, prompts, "again"))
    out["dead"] = repr(aengine.dead) if aengine.dead is not None else None


def warmup_scenario(engine, ep, prompts, out):
    """The start-up warm-up on both ranks at once (graphs run eagerly, keys recorded), then
    generate() with other work on each rank: rank 0 two prompts, rank 1 one of fewer tokens,
    then rank 1 none while rank 0 decodes. Each call returns on both ranks."""
    graphs = engine.runner.graphs = EagerGroupGraphs(engine.runner, 4)
    ep.reserve(max(graphs.sizes[-1], graphs.chunk_sizes[-1]))
    engine.warmup()
    out["warmup_keys"] = [list(k) for k in graphs.keys]
    out["min_blocks"], out["sizes"] = graphs.min_blocks, graphs.sizes
    out["chunk_sizes"] = graphs.chunk_sizes if engine.cfg.decode_kernels else []
    out["after_warmup"] = dict(engine.stats(), load=int(ep.take_load().sum()))
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    mine = prompts if ep.rank == 0 else [prompts[0]]
    out["uneven"] = [o.output_token_ids for o in engine.generate(mine, GREEDY if ep.rank == 0 else short)]
    out["solo"] = [o.output_token_ids for o in engine.generate(prompts[:1] if ep.rank == 0 else [], GREEDY)]
    out["stats"] = engine.stats()
    dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))


def ahead_scenario(engine, ep, out):
    """Async scheduling in lockstep (the agreement is on the host here, gloo): each rank steps its
    engine itself, prompts added at fixed calls of step() (rank 1's while rank 0 decodes ahead),
    once with graphs (run eagerly, keys recorded) and once without; the calls stop at the first
    agreement that finds the group idle, which every rank sees at the same step."""
    launched = []
    run_ahead = engine.runner.run_ahead
    engine.runner.run_ahead = lambda batch, ids: launched.append(len(batch)) or run_ahead(batch, ids)
    engine._run_ahead = True
    # call of step() -> prompt: rank 1's prompt meets the step rank 0 launched ahead of its first
    # decode; neither rank is idle before call 3, where both start to look for the end
    arrivals = {0: {0: 0, 2: 1}, 1: {1: 0}}[ep.rank]
    for form in ("graphs", "eager"):
        # other prompts the second time: a prefix-cache hit would replay a bounded window (V4.1 options)
        prompts = prompts_for(ep.rank, salt=int(form == "eager"))
        out[form + "_prompts"] = [prompts[i] for i in sorted(set(arrivals.values()))]
        graphs = engine.runner.graphs = EagerGroupGraphs(engine.runner, 4) if form == "graphs" else None
        if graphs is not None:
            ep.reserve(max(graphs.sizes[-1], graphs.chunk_sizes[-1]))
        tokens = {i: [] for i in range(len(prompts))}
        calls, first = 0, len(launched)
        while True:
            if calls in arrivals:
                engine.add_request(f"{form}-{arrivals[calls]}", prompts[arrivals[calls]], GREEDY)
            for o in engine.step():
                tokens[int(o.request_id.split("-")[1])] += o.new_token_ids
            calls += 1
            if calls > 3 and not ep.busy:
                break
        out[form] = [tokens[i] for i in sorted(tokens) if i in arrivals.values()]
        out[form + "_ahead_steps"] = len(launched) - first
        if graphs is not None:
            out["keys"], out["ahead_keys"] = [list(k) for k in graphs.keys], [list(k) for k in graphs.ahead]
    out["stats"] = engine.stats()
    dist.monitored_barrier(group=ep.migrate_group, timeout=datetime.timedelta(seconds=60))


def survive_peer_loss(aengine, ep, moe, prompts, out):
    """The group cannot decode without a rank, so the survivor must keep its placement and
    fail new requests with a clear error instead of hanging in a collective."""
    out["staged"] = ep.wait_staged("p1", 30)
    ep.abort("p1")
    out["phys2log_after"] = ep.phys2log.clone()
    out["slot0_after"], out["slot0_scale_after"] = slot0(moe)
    try:
        asyncio.run(asyncio.wait_for(generate_all(aengine, prompts[:1], "after-kill"), 30))
        out["after_kill"] = "served"
    except EngineDeadError as e:
        out["after_kill"] = f"EngineDeadError: {e}"
    except asyncio.TimeoutError:
        out["after_kill"] = "timed out"


async def _drain(stream):
    async for _ in stream:
        pass
