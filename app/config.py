"""Typed configuration of the wideep-serve application.

``AppConfig`` is the ``args:`` block of a Ray Serve config file::

    applications:
      - name: wideep
        route_prefix: /
        import_path: app.main:build_app
        args:
          model: {preset: tiny}
          prefill: {replicas: 1, group_size: 1, devices: cpu}
          decode: {dp_size: 2, devices: cpu}

Every model forbids unknown keys, so a typo fails validation with the key's
dotted path (``load_serve_config`` adds a "did you mean" hint).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineConfig

from placement.plan import CpuActorSpec, GroupSpec, Layout
from placement.topology import DOMAIN_LABEL, Cluster, TopologyError, cluster_from_description

Device = Literal["cpu", "cuda"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelConfig(_Strict):
    """Which model to serve. Give a checkpoint ``path`` or a built-in ``preset``."""

    name: str | None = Field(
        None,
        description="Name clients use in the OpenAI `model` field. Defaults to the preset name or the checkpoint directory name.",
    )
    path: str | None = Field(
        None,
        description="Checkpoint directory in Hugging Face layout (config.json, *.safetensors, tokenizer.json).",
    )
    preset: str | None = Field(
        None,
        description="Built-in model configuration, e.g. 'tiny' (random weights, for tests and CPU runs). With `path` set, the preset only fills gaps the checkpoint leaves.",
    )
    reasoning_parser: Literal["deepseek_r1", "deepseek_v3"] | None = Field(
        None,
        description="Separate a reasoning model's thinking from its answer in chat responses "
                    "(`reasoning_content`): 'deepseek_r1' for DeepSeek-R1, which always thinks; "
                    "'deepseek_v3' for DeepSeek-V3.1, which thinks when a request sets "
                    "`chat_template_kwargs: {thinking: true}`. Unset: the thinking stays in `content`.",
    )
    tool_call_parser: Literal["deepseek_v31", "deepseek_v3"] = Field(
        "deepseek_v31",
        description="The form the model writes tool calls in, named as vLLM's tool-call parsers are: "
                    "'deepseek_v31' (DeepSeek-V3.1 and later: the name, a separator, the JSON arguments) "
                    "or 'deepseek_v3' (DeepSeek-V3 and R1: `function`, the name, the arguments in a "
                    "```json block). Calls in either form are read from answers; strict tools' calls are "
                    "held to this one.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if not self.path and not self.preset:
            raise ValueError("model: set `path` (a checkpoint directory) or `preset` (e.g. 'tiny')")
        return self

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path:
            return Path(self.path).name
        return str(self.preset)


class AutoscalingConfig(_Strict):
    """Ray Serve autoscaling for prefill groups (same keys as Serve's own)."""

    min_replicas: int = Field(1, ge=0, description="Fewest prefill groups kept running.")
    max_replicas: int = Field(1, ge=1, description="Most prefill groups; placement reserves GPUs for this many.")
    initial_replicas: int | None = Field(None, ge=0, description="Groups started at deploy time (default: min_replicas).")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="Ongoing requests per prefill group the autoscaler aims for."
    )

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling_config: min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})"
            )
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError(
                f"autoscaling_config: initial_replicas ({self.initial_replicas}) must lie in "
                f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]"
            )
        return self

    def to_serve(self) -> dict[str, Any]:
        """The dict Ray Serve's ``autoscaling_config`` takes."""
        return self.model_dump(exclude_none=True)


class PrefillConfig(_Strict):
    """Prefill servers: small DP+EP groups that run prompts and push KV to decode."""

    replicas: int | None = Field(
        None, ge=0, description="Fixed number of prefill groups (Serve replicas). Exclusive with autoscaling_config; default 1."
    )
    autoscaling_config: AutoscalingConfig | None = Field(
        None, description="Autoscale the number of prefill groups instead of fixing it."
    )
    group_size: int = Field(
        1, ge=1, description="DP size of one prefill group (DEP<n>): its ranks and GPUs, kept on one node when they fit."
    )
    devices: Device = Field("cpu", description="'cuda' to run on GPUs, 'cpu' for the CPU test path.")

    @model_validator(mode="after")
    def _replicas_xor_autoscaling(self) -> "PrefillConfig":
        if self.replicas is not None and self.autoscaling_config is not None:
            raise ValueError("prefill: set either `replicas` or `autoscaling_config`, not both")
        if self.replicas is None and self.autoscaling_config is None:
            self.replicas = 1
        return self

    @property
    def max_groups(self) -> int:
        """Groups that may run at once: what placement must find room for."""
        if self.autoscaling_config is not None:
            return self.autoscaling_config.max_replicas
        return int(self.replicas or 0)


class DecodeConfig(_Strict):
    """Decode groups: Wide-EP (DP attention + EP MoE), one group per NVLink domain."""

    dp_size: int = Field(1, ge=1, description="Ranks (GPUs) in one decode group (DEP<n>); all in one NVLink domain.")
    num_groups: int = Field(1, ge=1, description="Independent decode groups; each needs its own NVLink domain room.")
    expert_parallel: bool = Field(
        True, description="With dp_size > 1, the ranks share the routed experts (DP attention + EP MoE, in "
                          "lockstep); off, every rank holds all experts and steps on its own.")
    devices: Device = Field("cpu", description="'cuda' to run on GPUs, 'cpu' for the CPU test path.")


class KVTransportConfig(_Strict):
    """How prefill hands KV blocks to decode."""

    backend: Literal["auto", "nixl", "ipc", "cuda_ipc", "nccl", "none"] = Field(
        "auto",
        description="'nixl': NIXL WRITE + notification, prefill and decode on any hosts; 'ipc': the prefill writes "
                    "straight into the decode rank's KV memory, mapped into its process (CUDA IPC between GPUs, "
                    "/dev/shm pool files on CPU), prefill and decode on one host only (a transfer to another host "
                    "fails and decode recomputes); 'auto': 'ipc' between GPUs of one host, NIXL otherwise and on "
                    "CPU; 'cuda_ipc': 'ipc' between GPUs only; 'none' always prefills on decode.",
    )
    local_prefill_max_tokens: int = Field(
        256,
        ge=0,
        description="Prompts whose uncached part is at most this many tokens are prefilled on the decode rank, with no transfer.",
    )
    timeout_s: float = Field(30.0, gt=0, description="A transfer later than this is abandoned and decode recomputes.")

    @field_validator("backend")
    @classmethod
    def _implemented(cls, v: str) -> str:
        if v == "nccl":
            raise ValueError("'nccl' is not implemented; use 'ipc' (prefill and decode on one host) or 'nixl'")
        return v

    @property
    def mode(self) -> str:
        """What the prefill and decode deployments are given: 'nixl', 'ipc' or 'auto' ('none'
        deploys no prefill server)."""
        return "ipc" if self.backend == "cuda_ipc" else self.backend


RoutingPolicy = Literal["session_affinity", "prefix", "least_loaded", "power_of_two", "random"]


class RoutingConfig(_Strict):
    """Ingress routing and session affinity."""

    session_header: str = Field("x-session-id", description="HTTP header carrying the session id.")
    policy: RoutingPolicy | None = Field(
        None,
        description="How a request picks its decode rank (and prefill replica). 'session_affinity' (default): a "
                    "session stays on the rank and prefill replica holding its prefix until they saturate; "
                    "requests without a session go by `prefix_aware`. 'prefix': every request is bound by its "
                    "system prompt and first user turn, sessions ignored. 'least_loaded': the rank with the "
                    "fewest running requests. 'power_of_two': the less loaded of two random ranks (Ray Serve's "
                    "default router). 'random'. Only 'session_affinity' uses the session router for prefill "
                    "replicas; the others leave them to Serve's default (power of two choices).")
    session_affinity: bool | None = Field(
        None, description="Older switch, kept for existing configs: true is policy 'session_affinity', false is "
                          "policy 'prefix' (sessions unbound, but requests sharing a system prompt and first turn "
                          "still meet on one rank; for a baseline without any stickiness use policy "
                          "'least_loaded'). Set `policy` instead; after validation it mirrors the policy.")
    max_running_per_rank: int = Field(
        64, ge=1, description="A decode rank with this many running requests counts as saturated; sticky sessions move on."
    )
    prefix_aware: bool = Field(
        True, description="Under policy 'session_affinity', route requests without a session by their system "
                          "prompt and first user turn; off, they go to the least loaded rank.")
    max_requests_per_rank: int = Field(
        256, ge=1, description="Admitted requests (running + queued) per decode rank; beyond it requests get "
                               "503 with Retry-After at once instead of queueing without bound.")
    token_timeout_s: float = Field(
        120.0, gt=0, description="A request whose next token takes longer fails with an error (never hangs).")

    @model_validator(mode="after")
    def _resolve_policy(self) -> "RoutingConfig":
        legacy = None if self.session_affinity is None else ("session_affinity" if self.session_affinity else "prefix")
        if self.policy is None:
            self.policy = legacy or "session_affinity"
        elif self.session_affinity is not None and self.session_affinity != (self.policy == "session_affinity"):
            raise ValueError(f"session_affinity: {str(self.session_affinity).lower()} contradicts policy "
                             f"{self.policy!r}; set only `policy`")
        self.session_affinity = self.policy == "session_affinity"
        return self


class HTTPConfig(_Strict):
    """Limits and access control of the OpenAI HTTP API."""

    max_body_bytes: int = Field(1_000_000, gt=0, description="Larger request bodies get 413.")
    max_tokens_limit: int | None = Field(
        None, gt=0, description="Largest max_tokens a request may ask for (default: the context length).")
    api_key_env: str | None = Field(
        None, description="Name of an environment variable holding the API key; when set, requests need "
                          "`Authorization: Bearer <key>`. The key itself never goes into the config file.")


class EPLBConfig(_Strict):
    """Expert-parallel load balancer (a CPU actor beside the decode group)."""

    enabled: bool = Field(True, description="Run the EPLB controller (only matters when decode.dp_size > 1).")
    interval_s: float = Field(30.0, gt=0, description="Seconds between load-window pulls and re-balancing decisions.")
    redundant_experts: int = Field(0, ge=0, description="Extra physical expert slots per layer for hot-expert replicas.")
    min_gain: float = Field(
        0.05, ge=0, description="Re-place only when the predicted drop of max/mean rank load, averaged over layers, "
                                "is at least this much.")
    stage_timeout_s: float = Field(
        30.0, gt=0, description="A migration whose staging or switch takes longer is abandoned; the old placement stays.")


ClusterSpec = Union[Literal["ray", "discover"], str, dict[str, Any]]


class PlacementConfig(_Strict):
    """Where the groups go. The cluster comes from Ray, from this host, or from a description."""

    cluster: ClusterSpec = Field(
        "ray",
        description=(
            "'ray': read the running Ray cluster's nodes and NVLink-domain labels at deploy time; "
            "'discover': this host only (NVML / nvidia-smi); a path to a described-cluster YAML; "
            "or the description inline (see configs/clusters/)."
        ),
    )
    domain_label: str = Field(DOMAIN_LABEL, description="Ray node label that names a node's NVLink domain.")
    pin_nodes: bool = Field(
        True, description="On a live Ray cluster, pin each rank to the node the plan chose, not only to its domain."
    )
    rank_cpus: float = Field(0.0, ge=0, description="CPUs reserved per GPU rank besides its GPU.")
    ingress_cpus: float = Field(1.0, gt=0, description="CPUs for the ingress / router replica.")
    eplb_cpus: float = Field(1.0, gt=0, description="CPUs for the EPLB controller.")
    ready_timeout_s: float = Field(
        300.0, gt=0, description="How long to wait for placement groups before failing with what could not be placed."
    )

    @field_validator("cluster")
    @classmethod
    def _check_cluster(cls, v: ClusterSpec) -> ClusterSpec:
        if isinstance(v, dict):
            try:
                cluster_from_description(v)
            except TopologyError as e:
                raise ValueError(str(e)) from None
        elif isinstance(v, str) and not v:
            raise ValueError("cluster: empty string; use 'ray', 'discover', a YAML path or a mapping")
        return v

    def described_cluster(self, base_dir: str | Path | None = None) -> Cluster | None:
        """The described cluster, or None when it comes from Ray or discovery."""
        if isinstance(self.cluster, dict):
            return cluster_from_description(self.cluster, source="inline description")
        if self.cluster in ("ray", "discover"):
            return None
        from placement.dryrun import load_cluster_file  # PyYAML only needed here

        path = Path(self.cluster)
        if base_dir is not None and not path.is_absolute() and not path.exists() and (Path(base_dir) / path).exists():
            path = Path(base_dir) / path
        return load_cluster_file(path)


class AppConfig(_Strict):
    """The whole application: the `args:` of the Serve application entry."""

    model: ModelConfig = Field(default_factory=lambda: ModelConfig(preset="tiny"), description="Model to serve.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Engine of every prefill server and decode rank (KV blocks, batching, dtype, replay mode); "
                    "`device` is set from prefill.devices / decode.devices.")
    prefill: PrefillConfig = Field(default_factory=PrefillConfig, description="Prefill groups.")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="Decode groups.")
    kv_transport: KVTransportConfig = Field(default_factory=KVTransportConfig, description="Prefill -> decode KV hand-off.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="Ingress routing and sessions.")
    http: HTTPConfig = Field(default_factory=HTTPConfig, description="HTTP API limits and auth.")
    eplb: EPLBConfig = Field(default_factory=EPLBConfig, description="Expert load balancer.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Cluster and placement.")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        # A section whose keys are all commented out is YAML null: take it as the defaults.
        if isinstance(data, dict):
            return {k: ({} if v is None and k in cls.model_fields else v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "AppConfig":
        if self.kv_transport.backend == "cuda_ipc" and "cpu" in (self.prefill.devices, self.decode.devices):
            raise ValueError("kv_transport.backend 'cuda_ipc' needs prefill.devices and decode.devices both 'cuda'")
        return self

    def layout(self) -> Layout:
        """The groups and CPU actors this config asks the cluster for."""
        groups = [
            GroupSpec(f"decode-{i}", "decode", self.decode.dp_size, self.decode.devices, span="domain")
            for i in range(self.decode.num_groups)
        ]
        groups += [
            GroupSpec(f"prefill-{i}", "prefill", self.prefill.group_size, self.prefill.devices, span="node")
            for i in range(self.prefill.max_groups)
        ]
        actors = [CpuActorSpec("ingress", self.placement.ingress_cpus)]
        if self.eplb.enabled and self.decode.dp_size > 1:
            actors.append(CpuActorSpec("eplb-controller", self.placement.eplb_cpus))
        return Layout(groups=groups, cpu_actors=actors, rank_cpus=self.placement.rank_cpus)


# ---------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config file that does not validate; the message lists every problem."""


def _known_fields(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names valid at ``loc`` (the parent of an unknown key), for hints."""
    current: Any = model
    for part in loc:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        f = current.model_fields.get(str(part))
        if f is None:
            return []
        ann = f.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def format_errors(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = prefix + ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            known = _known_fields(AppConfig, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = f"{where}: unknown field {str(loc[-1])!r}"
            if hint:
                msg += f" (did you mean {hint[0]!r}?)"
            elif known:
                msg += f" (known: {', '.join(known)})"
        else:
            msg = f"{where}: {e['msg']}"
        lines.append(msg)
    return "\n".join(lines)


def parse_app_config(args: dict[str, Any] | None, where: str = "args") -> AppConfig:
    """Validate an ``args`` mapping; raise ConfigError naming each bad field."""
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as e:
        raise ConfigError(f"invalid application config ({where}):\n{format_errors(e, where + '.')}") from None


def find_application(serve_config: dict[str, Any], app_name: str | None = None) -> tuple[int, dict[str, Any]]:
    """Pick the wideep application from a Serve config's ``applications`` list."""
    apps = serve_config.get("applications") if isinstance(serve_config, dict) else None
    if not isinstance(apps, list) or not apps:
        raise ConfigError("serve config: expected a non-empty `applications:` list")
    for i, app in enumerate(apps):
        if not isinstance(app, dict):
            raise ConfigError(f"serve config: applications[{i}] is not a mapping")
        if app_name is not None and app.get("name") == app_name:
            return i, app
        if app_name is None and str(app.get("import_path", "")).startswith("app.main:"):
            return i, app
    if app_name is not None:
        raise ConfigError(f"serve config: no application named {app_name!r}")
    return 0, apps[0]


def load_serve_config(path: str | Path, app_name: str | None = None) -> tuple[dict[str, Any], AppConfig]:
    """Read a Serve config YAML and validate its wideep application's args."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"serve config {str(p)!r}: file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"serve config {str(p)!r}: not valid YAML: {e}") from None
    i, app = find_application(data, app_name)
    return data, parse_app_config(app.get("args"), where=f"applications[{i}].args")
