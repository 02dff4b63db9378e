"""`build_app(args)`: the Serve application for `serve run config.yaml`.

    Ingress (HTTP + Python handle API, session binding)
      -> DecodeGroup (one replica owning the DP rank actors)
           -> PrefillServer (autoscaled; session-affine request router) for long uncached prompts
"""
from __future__ import annotations

import logging
from pathlib import Path

from ray.serve.config import RequestRouterConfig

from engine.checkpoint import ensure_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import context_limit

from .config import AppConfig, parse_app_config

log = logging.getLogger(__name__)

CHECKPOINT_ROOT = Path(__file__).resolve().parent.parent / "checkpoints"


def resolve_model(cfg: AppConfig) -> Path:
    """The checkpoint directory; a preset's random checkpoint is written on first start."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser().resolve()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {str(path)!r} holds no config.json")
        return path
    return ensure_checkpoint(cfg.model.preset, root=CHECKPOINT_ROOT).resolve()


def _rank_placement(cfg: AppConfig) -> dict | None:
    """GPU decode ranks go into one placement group packed into one NVLink domain, reserved by
    the DecodeGroup replica that owns them; CPU ranks need none."""
    if cfg.decode.devices != "cuda":
        return None
    return {"layout": cfg.layout(), "group_name": "decode-0", "domain_label": cfg.placement.domain_label,
            "pin_nodes": cfg.placement.pin_nodes, "rank_cpus": cfg.placement.rank_cpus,
            "timeout_s": cfg.placement.ready_timeout_s}


def build_app(args: dict | None = None):
    from deployments.decode_group import DecodeGroup
    from deployments.ingress import Ingress
    from deployments.prefill_server import PrefillServer
    from deployments.session_router import SessionAffinityRouter

    cfg = parse_app_config(args)
    model_path = str(resolve_model(cfg))
    engine_cfg = cfg.engine.model_dump(exclude={"device"})
    cfg.engine.index_scoring_layers(ModelConfig.from_file(model_path))  # fails at start, naming the field
    cpu_only = {"num_cpus": 0} if "cuda" not in (cfg.prefill.devices, cfg.decode.devices) else None

    prefill = None
    if cfg.kv_transport.backend != "none" and cfg.prefill.max_groups > 0:
        scaling = ({"autoscaling_config": cfg.prefill.autoscaling_config.to_serve()}
                   if cfg.prefill.autoscaling_config else {"num_replicas": cfg.prefill.replicas})
        # a group of one runs its engine in the replica; a larger group's ranks hold the GPUs
        in_replica = cfg.prefill.devices == "cuda" and cfg.prefill.group_size == 1
        actor = {"num_cpus": 0, **({"num_gpus": 1} if in_replica else {})}
        router = RequestRouterConfig(request_router_class=SessionAffinityRouter) \
            if cfg.routing.policy == "session_affinity" else None
        prefill = PrefillServer.options(
            ray_actor_options=actor, max_ongoing_requests=cfg.engine.max_num_seqs * cfg.prefill.group_size,
            **({"request_router_config": router} if router else {}), **scaling,
        ).bind(model_path, engine_cfg, cfg.prefill.devices, cfg.kv_transport.timeout_s, cfg.prefill.group_size,
               ModelConfig.from_file(model_path).n_routed_experts + cfg.eplb.redundant_experts,
               kv_transport=cfg.kv_transport.mode)

    # Admission is bounded by the decode group itself (503 + Retry-After beyond its capacity), so
    # Serve must let every request reach it rather than queue them unboundedly in front of it.
    capacity = cfg.routing.max_requests_per_rank * cfg.decode.dp_size
    decode = DecodeGroup.options(ray_actor_options=cpu_only or {"num_cpus": 0},
                                 max_ongoing_requests=2 * capacity + 16).bind(
        model_path, engine_cfg, cfg.decode.dp_size, cfg.decode.devices, prefill,
        cfg.routing.policy, cfg.routing.max_running_per_rank,
        cfg.kv_transport.local_prefill_max_tokens, cfg.kv_transport.timeout_s, _rank_placement(cfg),
        eplb=cfg.eplb.model_dump(), expert_parallel=cfg.decode.expert_parallel,
        max_requests_per_rank=cfg.routing.max_requests_per_rank, token_timeout_s=cfg.routing.token_timeout_s,
        kv_transport=cfg.kv_transport.mode, prefix_aware=cfg.routing.prefix_aware)
    max_model_len = context_limit(ModelConfig.from_file(model_path), EngineConfig(**engine_cfg))
    return Ingress.options(ray_actor_options=cpu_only or {"num_cpus": cfg.placement.ingress_cpus},
                           max_ongoing_requests=2 * capacity + 16).bind(
        decode, cfg.model.served_name, max_model_len, cfg.routing.model_dump(), cfg.http.model_dump(), capacity,
        reasoning_parser=cfg.model.reasoning_parser, tool_call_parser=cfg.model.tool_call_parser)
