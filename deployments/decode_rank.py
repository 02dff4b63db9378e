"""One DP rank of a decode group: an engine in a Ray actor.

A request's prompt is prefilled here when its uncached part is small (the usual next turn
of an agent session); otherwise a prefill server runs it and writes the prompt's KV into
blocks this rank reserved. A failed or late transfer falls back to local prefill.

KV transports (kv_transport): "nixl" (NIXL WRITE + notification, any hosts), "ipc" (the
prefill server writes straight into this rank's KV pool, mapped into its process: CUDA IPC, or
/dev/shm pool files on CPU; one host only), "auto" (both offered on CUDA, the prefill server
picks IPC when it is on this host; NIXL only on CPU).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import ray

from engine import SamplingParams
from engine.kv_ipc import IpcTransport, pool_tensors, shared_kv_pool

from .engine_host import load_engine, make_transport, report_stats
from .metrics import EngineMetrics

log = logging.getLogger(__name__)


@ray.remote
class DecodeRank:
    def __init__(self, rank: int, model_path: str, engine_cfg: dict, device: str,
                 prefill_handle=None, local_prefill_max_tokens: int = 256, transfer_timeout_s: float = 30.0,
                 kv_transport: str = "nixl"):
        if kv_transport not in ("nixl", "ipc", "auto", "none"):
            raise ValueError(f"kv_transport must be 'nixl', 'ipc', 'auto' or 'none', got {kv_transport!r}")
        self.rank = rank
        self.model_path, self.engine_cfg, self.device = model_path, engine_cfg, device
        self.prefill = prefill_handle if kv_transport != "none" else None
        self.kv_transport = kv_transport
        self.engine = self.transport = self.ipc = self.ep = None
        self.kv_pool = None  # the /dev/shm pool files (CPU, ipc)
        self.local_max = local_prefill_max_tokens
        self.timeout = transfer_timeout_s
        self.metrics = EngineMetrics("decode", rank)
        self.paths = {"remote": 0, "local": 0, "fallback": 0}
        self.transfers = {"ipc": 0, "nixl": 0}  # remote prefills by the transport that moved their KV
        self.kv_bytes = 0
        self.prefill_side_hits = 0  # prompt tokens the prefill server found in its own cache
        self._reporter = None

    def ping(self) -> bool:
        return self.engine is not None and self.engine.dead is None

    def endpoint(self) -> tuple[str, int]:
        """Where rank 0 hosts the group's torch.distributed rendezvous."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def start(self, ep: dict | None = None) -> dict:
        """Load the engine; with ep, join the group's expert parallelism first (every rank of
        the group must be starting at the same time)."""
        if ep is not None:
            self.ep = _join_expert_parallel(self.rank, ep, self.model_path)
        # "auto" exports over IPC on CUDA only: on CPU the pool would have to move into /dev/shm,
        # which Ray's object store shares.
        export = self.prefill is not None and (self.kv_transport == "ipc" or
                                               (self.kv_transport == "auto" and self.device == "cuda"))
        with shared_kv_pool() if export else contextlib.nullcontext() as self.kv_pool:
            self.engine = load_engine(self.model_path, self.engine_cfg, self.device, self.ep)
        if self.prefill is not None:
            if self.kv_transport != "ipc":
                self.transport = make_transport(self.engine, f"decode{self.rank}")
            if export:
                self.ipc = self._export_pool()
        return {"rank": self.rank, "max_model_len": self.engine.engine.max_model_len}

    def _export_pool(self) -> IpcTransport | None:
        e = self.engine.engine
        ipc = IpcTransport(f"decode{self.rank}-{uuid.uuid4().hex[:8]}", pool_tensors(e.runner.kv), e.cfg.block_size)
        try:
            ipc.metadata()  # export now: a pool that cannot be shared should fail the start, not a request
        except Exception as err:
            ipc.close()
            if self.kv_transport == "ipc":
                raise
            log.warning("decode rank %d: KV pool not shareable over IPC (%s); NIXL only", self.rank, err)
            return None
        return ipc

    # expert parallelism, driven by the EPLB controller -------------------------------------
    async def ep_take_load(self) -> list:
        return await asyncio.to_thread(self.engine.run_locked, lambda e: e.ep.take_load().tolist())

    def ep_status(self) -> dict:
        return {"rank": self.rank, "switches": self.ep.switches, "steps": self.engine.engine.num_steps,
                "phys2log": self.ep.phys2log.tolist()}

    def ep_stage(self, plan_id: str, phys2log: list, delay_s: float = 0.0) -> None:
        import torch
        self.ep.stage(plan_id, torch.tensor(phys2log), delay_s)

    async def ep_wait_staged(self, plan_id: str, timeout_s: float) -> dict:
        return await asyncio.to_thread(self.ep.wait_staged, plan_id, timeout_s)

    def ep_commit(self, plan_id: str) -> None:
        self.ep.commit(plan_id)

    def ep_abort(self, plan_id: str) -> bool:
        return self.ep.abort(plan_id)

    async def tokenize(self, request: dict) -> dict:
        return await asyncio.to_thread(self.engine.engine.tokenize, request)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.engine.engine.detokenize, token_ids)

    def stats(self) -> dict:
        return dict(self.engine.stats(), rank=self.rank, kv_bytes_received=self.kv_bytes,
                    prefill_side_hit_tokens=self.prefill_side_hits, kv_transport=self.kv_transport,
                    **{f"prefill_{k}": v for k, v in self.paths.items()},
                    **{f"kv_transfers_{k}": v for k, v in self.transfers.items()})

    async def generate(self, request: dict, session_id: str | None = None):
        """Streams one dict per token (RequestOutput.stream_dict)."""
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(report_stats(self.engine, self.metrics))
        rid = request["request_id"]
        params = SamplingParams(**request.get("sampling", {}))
        prompt = request.get("prompt_token_ids") or request.get("prompt")
        prior = request.get("prior_output_ids")
        # A prefill server samples the first token knowing no earlier outputs, and computes the
        # prompt's next-token logits at its end only: a retried request whose penalties count
        # earlier outputs or whose grammar is past them, and one asking for prompt logprobs, are
        # prefilled here.
        local = (bool(prior) and (params.frequency_penalty != 0 or params.presence_penalty != 0
                                  or params.structured_output is not None)
                 or params.prompt_logprobs is not None)
        remote = (self._remote_prefill(rid, params, session_id)
                  if (self.transport is not None or self.ipc is not None) and not local else None)
        start, last = time.monotonic(), None
        async for out in self.engine.generate(rid, prompt, params, messages=request.get("messages"),
                                              tools=request.get("tools"), remote_prefill=remote,
                                              prior_output_ids=prior,
                                              chat_template_kwargs=request.get("chat_template_kwargs")):
            now = time.monotonic()
            if out.new_token_ids:
                if last is None:
                    self.metrics.ttft.observe(now - start, self.metrics.tags)
                else:
                    self.metrics.itl.observe(now - last, self.metrics.tags)
                last = now
            yield out.stream_dict()

    def _remote_prefill(self, rid: str, params: SamplingParams, session_id: str | None):
        async def run(reservation: dict) -> dict | None:
            uncached = len(reservation["prompt_token_ids"]) - reservation["cached_blocks"] * reservation["block_size"]
            if uncached <= self.local_max:
                self._count("local")
                return None
            notif = f"kv:{rid}".encode()
            # what the first token's choice depends on (the prefill server samples it)
            sampling = {k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "seed", "logprobs",
                                                        "repetition_penalty", "logit_bias", "structured_output",
                                                        "stop_token_ids")}
            sampling["min_tokens"] = min(params.min_tokens, 1)  # of its one token
            payload = dict(reservation, request_id=rid, notif=notif, sampling=sampling)
            if self.transport is not None:
                payload["kv_peer"] = self.transport.metadata()
            if self.ipc is not None:
                payload["kv_ipc"] = self.ipc.metadata()
            # Wait for the NIXL notification while the prefill runs: with UCX over TCP the target
            # must make progress (the transport's polling) for the write to complete at all. An
            # IPC write needs no notification: the prefill's reply comes after its bytes landed.
            waiter = (asyncio.ensure_future(self.transport.wait_notification_async(notif, self.timeout))
                      if self.transport is not None else None)
            try:
                reply = await asyncio.wait_for(self.prefill.prefill.remote(payload, session_id=session_id),
                                               self.timeout)
                via = reply.get("transport", "nixl")
                if via not in self.transfers:
                    raise RuntimeError(f"prefill server replied with unknown transport {via!r}")
                if via == "nixl" and (waiter is None or not await waiter):
                    raise TimeoutError("KV written but no notification arrived")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure of the remote path: recompute here
                log.warning("remote prefill of %s failed (%s); prefilling locally", rid, e)
                if self.transport is not None:
                    self.transport.discard_notification(notif)  # a late write must not be mistaken later
                self._count("fallback")
                return None
            finally:
                if waiter is not None:
                    waiter.cancel()
            self._count("remote")
            self.transfers[via] += 1
            self.kv_bytes += reply["bytes"]
            self.prefill_side_hits += reply["prefix_hit_tokens"]
            self.metrics.kv_bytes.inc(reply["bytes"], self.metrics.tags)
            return {"first_token": reply["first_token"], "first_logprobs": reply.get("first_logprobs")}
        return run

    def _count(self, path: str) -> None:
        self.paths[path] += 1
        self.metrics.prefill_path(path)


def _join_expert_parallel(rank: int, ep: dict, model_path: str):
    from datetime import timedelta

    import torch.distributed as dist

    from engine.config import ModelConfig
    from engine.ep import ExpertParallel, GroupStep, initial_placement
    from engine.host_agreement import host_exchange

    dist.init_process_group(ep["backend"], init_method=f"tcp://{ep['addr']}:{ep['port']}", rank=rank,
                            world_size=ep["world"], timeout=timedelta(seconds=ep.get("timeout_s", 120)))
    # staging traffic runs on its own group so it never queues behind the forward's collectives
    migrate = dist.new_group(backend="gloo")
    # The step's agreement on the host, so a rank can launch a step while the one before runs:
    # shared memory on each host, TCP between hosts (CPU groups agree over their gloo group).
    exchange = None
    if ep["backend"] == "nccl":
        exchange = host_exchange(rank, ep["world"], GroupStep.WIDTH, dist.new_group(backend="gloo"),
                                 timeout_s=ep.get("timeout_s", 120), address=ray.util.get_node_ip_address())
    cfg = ModelConfig.from_file(model_path)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return ExpertParallel(rank, ep["world"], initial_placement(layers, cfg.n_routed_experts, ep["num_slots"]),
                          cfg.n_routed_experts, group=dist.group.WORLD, migrate_group=migrate, exchange=exchange)
