"""Expert parallelism across the data-parallel ranks of a decode group, and live expert
migration (the EPLB's moving part).

Each rank runs attention on its own requests (DP) and holds `slots_per_rank` physical expert
slots; global slot s lives on rank s // slots_per_rank. A MoE layer gathers every rank's
rows (one all-gather), each rank routes all of them itself and applies the experts it holds,
and a reduce-scatter sums the ranks' partial outputs and hands each rank its own rows back
(simple and exact; an all-to-all dispatch is the faster form for large groups).

Every rank's rows are padded to one count the group agrees on once a step (`agree`: one
all-gather of each rank's rows and step shape), so the MoE layers have fixed shapes: no
count is read back to the host inside the forward, pairs of other ranks' slots are dropped
by the expert kernels rather than compacted, and a decode step with its collectives can be
captured in a CUDA graph. NCCL requires a captured collective to be captured, and replayed,
by every rank together: the graph a step uses is named by group-wide values only (the
agreed rows, block-table width and sparse flag), so all ranks capture and replay the same
graphs at the same steps, an idle rank replaying its graph with padding rows only.

The ranks run in lockstep: every rank steps every time, idle or not, and a rank with nothing
to do still runs an idle forward whenever another rank has work, so that the MoE collectives
match. The same all-gather carries "I have staged and been told to commit plan P": the new
placement takes effect at the first step every rank reports it, so no rank can switch alone
and dispatch is never inconsistent. Staging copies incoming experts on a background thread
over a second process group while decode goes on with the old placement.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .host_agreement import GlooExchange, _all_gather
from .moe import ExpertMap, MoE


# Newer torch names the tensor forms of these collectives *_single (the old names warn).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PlanError(ValueError):
    """An expert placement that cannot be applied, named in the message."""


def initial_placement(num_layers: int, num_logical: int, num_slots: int) -> torch.Tensor:
    """Every expert once in order, then redundant slots replicating experts 0, 1, ..."""
    if num_slots < num_logical:
        raise PlanError(f"{num_slots} slots cannot hold {num_logical} experts")
    row = torch.cat([torch.arange(num_logical), torch.arange(num_slots - num_logical) % num_logical])
    return row.repeat(num_layers, 1)


def validate_plan(phys2log: torch.Tensor, num_layers: int, num_slots: int, num_logical: int) -> None:
    if not isinstance(phys2log, torch.Tensor) or phys2log.dim() != 2:
        raise PlanError("a plan is a 2-D tensor [moe_layers, slots] of logical expert ids")
    if tuple(phys2log.shape) != (num_layers, num_slots):
        raise PlanError(f"plan shape {tuple(phys2log.shape)}, expected {(num_layers, num_slots)}")
    if phys2log.min() < 0 or phys2log.max() >= num_logical:
        raise PlanError(f"plan holds expert ids outside 0..{num_logical - 1}")
    for layer in range(num_layers):
        held = torch.bincount(phys2log[layer].long(), minlength=num_logical)
        if int(held.min()) == 0:
            missing = torch.nonzero(held == 0).flatten().tolist()
            raise PlanError(f"MoE layer {layer}: experts {missing[:8]} have no slot")


@dataclass
class GroupStep:
    """What the ranks agreed for one step (ExpertParallel.agree)."""
    WIDTH = 6       # values each rank hands in: these five, and whether it has staged a committed plan
    rows: int       # most rows any rank computes: every rank's MoE rows are padded to it (or its graph size)
    graph: bool     # every rank's step can replay a decode graph
    chunk: bool     # every rank's step can replay a chunk graph (a row per token: prompt chunks beside decodes)
    width: int      # widest block table of any rank
    sparse: bool    # any rank's step needs the indexer


@dataclass
class Migration:
    plan_id: str
    phys2log: torch.Tensor                      # [layers, slots], the new placement
    staged: dict = field(default_factory=dict)  # moe layer -> its slot tensors (MoE.slot_tensors) for this rank
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    committed: bool = False
    bytes_received: int = 0
    started: float = field(default_factory=time.monotonic)
    not_before: float = 0.0                     # a deliberately slowed migration starts no earlier
    todo: list | None = None                    # GPU: layers still to enqueue
    wanted: dict | None = None                  # GPU: (layer, source rank) -> slot pairs
    event: object = None                        # GPU: recorded after the last copy


class ExpertParallel:
    def __init__(self, rank: int, world: int, phys2log: torch.Tensor, num_logical: int,
                 group=None, migrate_group=None, exchange=None):
        """group: the forward's collectives (NCCL on GPUs); migrate_group: staging traffic;
        exchange (engine/host_agreement.py, GPU ranks): the step's agreement on the host, off the
        GPU's stream, so that a step can be agreed and launched while the one before still runs
        (async scheduling). Without it a GPU group agrees over `group`, which waits for the GPU;
        a CPU group agrees over `group` itself (gloo)."""
        num_layers, num_slots = phys2log.shape
        if num_slots % world:
            raise PlanError(f"{num_slots} expert slots do not split evenly over {world} ranks")
        validate_plan(phys2log, num_layers, num_slots, num_logical)
        self.rank, self.world = rank, world
        self.num_logical = num_logical
        self.spr = num_slots // world
        self.base = rank * self.spr
        self.phys2log = phys2log.clone().long()
        # Fixed-width maps, updated in place by a switch (captured graphs read these tensors).
        self.max_replicas = num_slots - num_logical + 1
        self.maps = [ExpertMap(self.phys2log[layer], num_logical, self.max_replicas) for layer in range(num_layers)]
        self.rows = 0            # this step's MoE rows per rank (set_rows: agree, then the runner's graph padding)
        self.busy = False        # whether any rank had a row at the last agreement
        self.wait_s = 0.0        # time spent in agreements: waiting for slower ranks (and, over NCCL, the GPU)
        self.counts = None       # [world] real rows of each rank this step, on the forward's device
        self.real = None         # [world * rows]: which gathered rows are real (set_rows), or None
        self._real_rows = None   # its memory, for up to `reserve` rows
        self.group, self.migrate_group, self.exchange = group, migrate_group, exchange
        self.moes: list[MoE] = []
        self._staging = None
        self._bulk = None
        self.layers_per_step = 4
        self._stager: threading.Thread | None = None
        self.device = torch.device("cpu")
        self.peers = None        # GPU: every rank's expert weights, opened through CUDA IPC
        self.copy_stream = None
        self.pending: Migration | None = None
        self.switches = 0
        self._lock = threading.Lock()

    # set-up -----------------------------------------------------------------------------
    def local_phys2log(self) -> list[list[int]]:
        return self.phys2log[:, self.base:self.base + self.spr].tolist()

    def attach(self, moes: list[MoE]) -> None:
        self.moes = moes
        self.device = moes[0].w13.device if moes else torch.device("cpu")
        for moe in moes:
            moe.ep = self
        for m in self.maps:
            m.to(self.device)
        if self.exchange is None and self.device.type == "cpu":
            self.exchange = GlooExchange(self.group, self.world)
        # Per layer, each logical expert's replicas as this rank's slots (-1: another rank's),
        # which the routing kernel reads directly.
        self.local_log2phys = [torch.empty_like(m.log2phys) for m in self.maps]
        self._local_tables()
        self.counts = torch.zeros(self.world, dtype=torch.long, device=self.device)

    @property
    def host_agreement(self) -> bool:
        """Whether the step's agreement leaves the GPU's stream alone (a host exchange). Only then
        can the next step be agreed while this one runs."""
        return self.exchange is not None

    def reserve(self, max_rows: int) -> None:
        """Keep the real-row mask of steps up to max_rows rows (the largest decode graph) in one
        buffer, filled once a step before the forward, which graphs read in place; larger
        (eager) steps make theirs in every MoE layer."""
        self._real_rows = torch.zeros(self.world * max_rows, dtype=torch.bool, device=self.device)
        self._arange = torch.arange(max_rows, device=self.device)

    def set_rows(self, rows: int) -> None:
        """This step's MoE rows per rank: every rank pads its rows to this many."""
        self.rows = rows
        self.real = None
        if self._real_rows is not None and rows * self.world <= self._real_rows.numel():
            view = self._real_rows[:self.world * rows].view(self.world, rows)
            torch.lt(self._arange[:rows][None, :], self.counts[:, None], out=view)
            self.real = view.view(-1)

    def pad_only(self, rows: int) -> None:
        """A step outside the agreement in which every rank computes `rows` padding rows and no
        real one: the graphs all ranks capture together at start (DecodeGraphs.capture_short)."""
        self.counts.zero_()
        self.set_rows(rows)

    def _local_tables(self) -> None:
        for m, local in zip(self.maps, self.local_log2phys):
            g = m.log2phys
            local.copy_(torch.where((g >= self.base) & (g < self.base + self.spr), g - self.base, -1))

    def share_weights(self) -> None:
        """GPU ranks of one host: open every peer's expert weights through CUDA IPC once, so
        staging is a plain peer copy over NVLink on a side stream (no collective to order
        against the forward's). Call on every rank after the weights are loaded."""
        from torch.multiprocessing.reductions import reduce_tensor

        mine = [[reduce_tensor(t) for t in m.slot_tensors()] for m in self.moes]
        handles = [None] * self.world
        dist.all_gather_object(handles, mine, group=self.migrate_group)
        self.peers = []
        for r, layers in enumerate(handles):
            if r == self.rank:
                self.peers.append([m.slot_tensors() for m in self.moes])
            else:
                self.peers.append([[rebuild(*args) for rebuild, args in layer] for layer in layers])
        self.copy_stream = torch.cuda.Stream()
        # Staging buffers for every local slot, allocated once: a fresh multi-GB allocation per
        # migration costs more than the copies themselves.
        self._staging = [[torch.empty_like(t) for t in m.slot_tensors()] for m in self.moes]

    # lockstep ---------------------------------------------------------------------------
    def agree(self, rows: int, graph: bool = False, width: int = 0, sparse: bool = False,
              chunk: bool = False) -> GroupStep:
        """Called by every rank at every step, idle ones included (rows 0): one all-gather of
        (rows, graph, chunk, width, sparse, staged), and one read of it on the host, for the whole
        step (on the host group where there is one, `host_agreement`).
        Sets `rows` (the MoE rows of every rank, until the runner pads them to a graph's size),
        `counts` (each rank's real rows, which the MoE layers read on the device) and `busy`
        (whether any rank has a row: if not, nobody runs a forward). Applies a committed
        migration, before this step's forward, once every rank has staged and committed it."""
        if self.peers is not None:
            self._advance()
        with self._lock:
            ready = self.pending is not None and self.pending.committed and self.pending.done.is_set() \
                and self.pending.error is None
        mine = [rows, int(graph), int(chunk), width, int(sparse), int(ready)]
        start = time.perf_counter()
        if self.exchange is not None:
            host = self.exchange.exchange(mine)
            self.wait_s += time.perf_counter() - start
            counts = torch.tensor([r[0] for r in host], dtype=torch.long)
            # pinned: a pageable copy would wait for the step still running on the GPU
            self.counts.copy_(counts.pin_memory() if self.device.type == "cuda" else counts, non_blocking=True)
        else:
            # on the forward group's device (NCCL gathers only GPU tensors); its read waits for the GPU
            every = torch.empty(self.world * len(mine), dtype=torch.long, device=self.device)
            _all_gather(every, torch.tensor(mine, dtype=torch.long, device=self.device), group=self.group)
            every = every.view(self.world, len(mine))
            self.counts.copy_(every[:, 0])
            host = every.tolist()
            self.wait_s += time.perf_counter() - start
        if all(r[5] for r in host):
            self._switch()
        step = GroupStep(rows=max(r[0] for r in host), graph=all(r[1] for r in host), chunk=all(r[2] for r in host),
                         width=max(r[3] for r in host), sparse=any(r[4] for r in host))
        self.busy = step.rows > 0
        self.set_rows(step.rows)
        return step

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ok (a captured graph: all ranks or none may use it)."""
        flag = torch.tensor([int(ok)], dtype=torch.long, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    # MoE --------------------------------------------------------------------------------
    def moe_forward(self, moe: MoE, x: torch.Tensor, shared: tuple | None = None) -> torch.Tensor:
        """This rank's rows x [t, H] (t <= rows) -> the sum of their routed experts, [t, H],
        wherever the experts live; with `shared` (MoE._shared_slot), plus their shared expert,
        computed by this rank in the routed experts' launches. Fixed shapes throughout: capturable."""
        t, hidden = x.shape
        rows = self.rows
        if t > rows:
            raise RuntimeError(f"a MoE layer got {t} rows, more than the {rows} the group agreed on")
        if t < rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, rows - t))
        xs = x.new_empty(self.world * rows, hidden)
        _all_gather(xs, x.contiguous(), group=self.group)
        # Every rank routes the same gathered rows with the same kernels, so all agree on every
        # pair's slot without a second collective; the map names this rank's slots only.
        layer = moe.layer_index
        real = self.real
        if real is None:
            real = (torch.arange(rows, device=xs.device)[None, :] < self.counts[:, None]).view(-1)
        # padding rows are nobody's: slot -1, set by the routing launch, which also counts the load
        weights, slots = moe.route_to(xs, self.local_log2phys[layer], self.maps[layer].num_replicas, real)
        # About rows * k of the group's pairs are this rank's when the load is balanced. The shared
        # expert takes this rank's own rows, whose sums come back to it alone.
        own = (self.rank * rows, (self.rank + 1) * rows)
        out = moe.expert_pairs(xs, None, slots.flatten(), weights.flatten(), count=False,
                               live_pairs=rows * slots.shape[1], shared=shared, shared_rows=own)
        summed = x.new_empty(rows, hidden)
        _reduce_scatter(summed, out.contiguous(), group=self.group)
        return summed[:t]

    def take_load(self) -> torch.Tensor:
        """Tokens per local slot per MoE layer since the last call: [layers, slots_per_rank]."""
        return torch.stack([moe.take_load().cpu() for moe in self.moes])

    # migration --------------------------------------------------------------------------
    def stage(self, plan_id: str, phys2log: torch.Tensor, delay_s: float = 0.0) -> None:
        """Start copying the experts this rank lacks under `phys2log` into staging buffers while
        decode goes on with the current placement. GPU (peers opened): the copies are enqueued
        on a side stream at step boundaries, `layers_per_step` layers at a time, so no Python
        thread competes with the forward's kernel launches for the GIL. CPU: a background
        thread sends and receives over the migration group."""
        phys2log = torch.as_tensor(phys2log).long()
        validate_plan(phys2log, *self.phys2log.shape, self.num_logical)
        with self._lock:
            if self.pending is not None:
                raise PlanError(f"plan {self.pending.plan_id!r} is still in progress")
            if self._stager is not None and self._stager.is_alive():  # an abandoned plan's copies
                raise PlanError("the staging of an abandoned plan is still running; try again shortly")
            mig = Migration(plan_id, phys2log, not_before=time.monotonic() + delay_s)
            if self.peers is not None:
                mig.todo = list(range(len(self.moes)))
                mig.wanted = self._wanted(phys2log)
                self.pending = mig
                return
            self.pending = mig
            self._stager = threading.Thread(target=self._stage, args=(mig,), name=f"stage-{plan_id}", daemon=True)
        self._stager.start()

    def wait_staged(self, plan_id: str, timeout_s: float) -> dict:
        mig = self._current(plan_id)
        if not mig.done.wait(timeout_s):
            return {"staged": False, "error": f"staging not finished after {timeout_s} s"}
        if mig.error is not None:
            return {"staged": False, "error": f"{type(mig.error).__name__}: {mig.error}"}
        return {"staged": True, "bytes": mig.bytes_received, "seconds": time.monotonic() - mig.started}

    def commit(self, plan_id: str) -> None:
        with self._lock:
            self._current(plan_id).committed = True

    def abort(self, plan_id: str) -> bool:
        with self._lock:
            if self.pending is None or self.pending.plan_id != plan_id:
                return False
            self.pending = None  # a staging thread still running writes only into its own buffers
            return True

    def _current(self, plan_id: str) -> Migration:
        mig = self.pending
        if mig is None or mig.plan_id != plan_id:
            raise PlanError(f"no plan {plan_id!r} in progress here")
        return mig

    def transfers(self, new: torch.Tensor) -> list[tuple[int, int, int, int, int]]:
        """(layer, src_rank, src_slot, dst_rank, dst_slot) for every slot whose expert its rank
        does not already hold; the same list on every rank, so sends and receives pair up."""
        moves = []
        for layer in range(new.shape[0]):
            cur = self.phys2log[layer]
            for dst_slot in range(new.shape[1]):
                expert = int(new[layer, dst_slot])
                dst_rank = dst_slot // self.spr
                mine = cur[dst_rank * self.spr:(dst_rank + 1) * self.spr]
                if bool((mine == expert).any()):
                    continue
                src_slot = int(torch.nonzero(cur == expert)[0])
                moves.append((layer, src_slot // self.spr, src_slot, dst_rank, dst_slot))
        return moves

    def _stage(self, mig: Migration) -> None:
        try:
            time.sleep(max(0.0, mig.not_before - time.monotonic()))
            for k in range(len(self.moes)):
                self._local_layer(mig, k)
            requests = []
            for i, (layer, src_rank, src_slot, dst_rank, dst_slot) in enumerate(self.transfers(mig.phys2log)):
                moe = self.moes[layer]
                # one tag per slot tensor (the FP8 experts' scales travel with their weights)
                tags = len(moe.slot_tensors())
                if src_rank == self.rank:
                    s = src_slot - self.base
                    for j, t in enumerate(moe.slot_tensors()):
                        requests.append(dist.isend(t[s].clone(), dst_rank, group=self.migrate_group, tag=tags * i + j))
                if dst_rank == self.rank:
                    d = dst_slot - self.base
                    for j, staged in enumerate(mig.staged[layer]):
                        buf = staged[d]
                        requests.append(dist.irecv(buf, src_rank, group=self.migrate_group, tag=tags * i + j))
                        mig.bytes_received += buf.numel() * buf.element_size()
            for r in requests:
                r.wait()
        except BaseException as e:  # reported through wait_staged; the old placement stays
            mig.error = e
        finally:
            mig.done.set()

    def _advance(self) -> None:
        """GPU staging: enqueue the next layers' copies; mark done once the stream got there."""
        mig = self.pending
        if mig is None or mig.todo is None or mig.done.is_set() or time.monotonic() < mig.not_before:
            return
        try:
            with torch.cuda.stream(self.copy_stream):
                for _ in range(min(self.layers_per_step, len(mig.todo))):
                    k = mig.todo.pop(0)
                    self._local_layer(mig, k)
                    self._peer_layer(mig, k)
                if not mig.todo and mig.event is None:
                    mig.event = torch.cuda.Event()
                    mig.event.record(self.copy_stream)
            if mig.event is not None and mig.event.query():
                mig.done.set()
        except BaseException as e:
            mig.error = e
            mig.done.set()

    def _local_layer(self, mig: Migration, k: int) -> None:
        """Staging buffers of layer k, starting from the experts this rank already holds (one
        gather per layer: few Python calls)."""
        moe = self.moes[k]
        current = moe.slot_tensors()
        staged = self._staging[k] if self._staging else [torch.empty_like(t) for t in current]
        cur = self.phys2log[k, self.base:self.base + self.spr].tolist()
        pairs = [(cur.index(e), s) for s, e in enumerate(mig.phys2log[k, self.base:self.base + self.spr].tolist())
                 if e in cur]
        if pairs:
            src = torch.tensor([p[0] for p in pairs], device=staged[0].device)
            dst = torch.tensor([p[1] for p in pairs], device=staged[0].device)
            for buf, t in zip(staged, current):
                buf.index_copy_(0, dst, t.index_select(0, src))
        mig.staged[k] = staged

    def _wanted(self, new: torch.Tensor) -> dict[tuple[int, int], list[tuple[int, int]]]:
        """(layer, source rank) -> [(source local slot, destination local slot)] this rank pulls."""
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for layer, src_rank, src_slot, dst_rank, dst_slot in self.transfers(new):
            if dst_rank == self.rank:
                wanted.setdefault((layer, src_rank), []).append((src_slot - src_rank * self.spr,
                                                                 dst_slot - self.base))
        return wanted

    def _peer_layer(self, mig: Migration, k: int) -> None:
        """Peer copies of layer k: when most of a source's slots are wanted, one bulk copy of its
        whole layer over NVLink and a local gather beat many small copies."""
        staged = mig.staged[k]
        for src_rank in range(self.world):
            pairs = mig.wanted.get((k, src_rank))
            if not pairs:
                continue
            sources = self.peers[src_rank][k]
            if 2 * len(pairs) >= self.spr:
                if self._bulk is None:
                    self._bulk = [torch.empty_like(t) for t in staged]
                src_idx = torch.tensor([p[0] for p in pairs], device=staged[0].device)
                dst_idx = torch.tensor([p[1] for p in pairs], device=staged[0].device)
                for buf, bulk, src in zip(staged, self._bulk, sources):
                    bulk.copy_(src, non_blocking=True)
                    buf.index_copy_(0, dst_idx, bulk.index_select(0, src_idx))
            else:
                for s, d in pairs:
                    for buf, src in zip(staged, sources):
                        buf[d].copy_(src[s], non_blocking=True)
            mig.bytes_received += len(pairs) * sum(t[0].numel() * t.element_size() for t in staged)

    def _switch(self) -> None:
        """Swap weights and maps; runs on every rank at the same lockstep step."""
        with self._lock:
            mig, self.pending = self.pending, None
        for k, moe in enumerate(self.moes):
            for t, staged in zip(moe.slot_tensors(), mig.staged[k]):
                t.copy_(staged)
            moe.local_phys2log = mig.phys2log[k, self.base:self.base + self.spr].tolist()
        self.phys2log = mig.phys2log.clone()
        for layer, m in enumerate(self.maps):
            m.update_(self.phys2log[layer])
        self._local_tables()
        self.switches += 1
