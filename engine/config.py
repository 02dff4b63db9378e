"""Model and engine configuration.

`ModelConfig` reads a HuggingFace DeepSeek-V3 `config.json` (same key names) plus the
V4.1-style options. Unknown keys are an error: a typo in a config should not be
silently ignored.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Keys that HF DeepSeek config.json files carry but that do not change the math here.
_IGNORED_HF_KEYS = {
    "architectures", "model_type", "auto_map", "torch_dtype", "dtype", "transformers_version",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "attention_dropout", "pretraining_tp", "num_nextn_predict_layers", "ep_size",
    "aux_loss_alpha", "seq_aux",
    "output_router_logits", "router_aux_loss_coef",
}


def fp8_block_cols_fit(cols: int) -> bool:
    """Whether FP8 expert blocks this many columns wide fit the fused kernels: a k step stays
    inside one block, so a power of two of at least one MMA's depth."""
    return cols >= 16 and cols & (cols - 1) == 0


class FP8Quantization(BaseModel):
    """`quantization_config` of DeepSeek's FP8 checkpoints: the Linear weights are float8 e4m3
    with one float32 scale per [rows, cols] block (`<name>.weight_scale_inv`, a multiplier
    despite its name). They are dequantized to the serving dtype at load, except the routed experts'
    where they are served in FP8 (EngineConfig.fp8_experts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    weight_block_size: list[int] = Field(min_length=2, max_length=2,
                                         description="[rows, cols] of the weight block that shares one scale")
    activation_scheme: Literal["dynamic"] = Field(
        "dynamic", description="activations quantized on the fly by FP8 kernels; dequantized weights ignore it")
    scale_fmt: Literal["ue8m0"] | None = Field(
        None, description="DeepSeek-V3.1 and later: every scale is a power of two; dequantizing is unchanged")
    modules_to_not_convert: list[str] | None = Field(
        None, description="HF's list of modules left unquantized; which tensors are FP8 is read from the tensors")

    @field_validator("weight_block_size")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if min(v) <= 0:
            raise ValueError(f"block sizes must be positive, got {v}")
        return v


class YarnRope(NamedTuple):
    """YaRN's parameters (`rope_scaling` type "yarn", as every released DeepSeek-V2/V3 config
    has), with transformers' defaults. engine/layers.py yarn_frequencies blends interpolated and
    original frequencies; the two scale factors below are the rest of it."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def table_scale(self) -> float:
        """What cos/sin are multiplied by. DeepSeek's mscale/mscale_all_dim pair cancels it out
        when equal (V3: 1.0/1.0, V2-Lite: 0.707/0.707) and moves the whole length correction
        into the softmax scale instead."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's attention multiplies its softmax scale by this squared (once for q, once for
        k): mscale(factor, mscale_all_dim), 1 without mscale_all_dim."""
        return yarn_mscale(self.factor, self.mscale_all_dim) if self.mscale_all_dim else 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# Keys of a rope dict besides the type: rope_theta (transformers 5 moves it there) and YaRN's.
_YARN_KEYS = set(YarnRope._fields) | {"rope_theta"}


def _number(field: str, value, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{field} must be > 0, got {value!r}")
    return float(value)


def _parse_yarn(field: str, rope: dict, max_position_embeddings: int) -> YarnRope:
    """YarnRope from a rope dict, each bad or missing value a ValueError naming `field.key`."""
    unknown = sorted(set(rope) - _YARN_KEYS - {"type", "rope_type"})
    if unknown:
        raise ValueError(f"{field}: unknown yarn keys {unknown} (known: {sorted(_YARN_KEYS)})")
    if rope.get("factor") is None:
        raise ValueError(f"{field}.factor: yarn needs a factor (the context stretch, e.g. 40 for DeepSeek-V3)")
    factor = _number(f"{field}.factor", rope["factor"], positive=True)
    # transformers' default where a config leaves it out: no stretch past the configured length
    original = rope.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ValueError(f"{field}.original_max_position_embeddings must be a positive integer, got {original!r}")
    # transformers reads a 0 or null beta as its default (`or`), so this does too
    beta_fast = _number(f"{field}.beta_fast", rope.get("beta_fast") or 32, positive=True)
    beta_slow = _number(f"{field}.beta_slow", rope.get("beta_slow") or 1, positive=True)
    if beta_fast < beta_slow:
        raise ValueError(f"{field}.beta_fast ({beta_fast}) must be >= beta_slow ({beta_slow})")
    optional = {}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if rope.get(key) is not None:
            optional[key] = _number(f"{field}.{key}", rope[key], positive=key == "attention_factor")
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{field}.truncate must be true or false, got {truncate!r}")
    if rope.get("rope_theta") is not None:
        _number(f"{field}.rope_theta", rope["rope_theta"], positive=True)
    return YarnRope(factor, original, beta_fast, beta_slow, truncate=truncate, **optional)


class ModelConfig(BaseModel):
    """A DeepSeek-family MoE model. Field names follow HF `config.json`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="FFN width of the dense (first_k_dense_replace) layers")
    moe_intermediate_size: int = Field(gt=0, description="FFN width of each routed expert")
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int | None = Field(None, description="unused by MLA; accepted for HF compatibility")
    n_shared_experts: int = Field(ge=0)
    n_routed_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    n_group: int = Field(1, gt=0)
    topk_group: int = Field(1, gt=0)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # DeepSeek-V2 configs name other routing here (softmax scores, greedy top-k): refused rather
    # than served with V3's routing, which would load and generate without complaint.
    scoring_func: Literal["sigmoid"] = Field("sigmoid", description="router scores: DeepSeek-V3's sigmoid")
    topk_method: Literal["noaux_tc"] = Field(
        "noaux_tc", description="DeepSeek-V3's group-limited top-k over the bias-corrected scores")
    moe_layer_freq: Literal[1] = Field(1, description="every layer from first_k_dense_replace on is an MoE layer")
    first_k_dense_replace: int = Field(0, ge=0)
    q_lora_rank: int | None = Field(None, description="None: q_proj directly, else q_a/q_b low-rank")
    kv_lora_rank: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    hidden_act: Literal["silu"] = "silu"
    max_position_embeddings: int = Field(4096, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    quantization_config: FP8Quantization | None = Field(
        None, description="DeepSeek's block FP8 checkpoints (weights dequantized at load); None: unquantized")

    # V4.1-style options (all off = exactly DeepSeek-V3).
    kv_source_layer_ids: list[int] | None = Field(
        None, description="layers that produce the compressed global latent KV; later layers reuse the latest one")
    sliding_window: int | None = Field(
        None, gt=0, description="each layer keeps its own window KV of the last W positions")
    index_topk: int | None = Field(None, gt=0, description="attention reads only the top-k global KV entries")
    index_n_heads: int = Field(4, gt=0, description="scoring heads of the indexer")
    index_head_dim: int = Field(32, gt=0, description="key/query width of the indexer")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError("num_experts_per_tok exceeds the experts available in topk_group groups")
        if self.n_group > 1 and per_group < 2:
            raise ValueError("group-limited routing needs at least 2 experts per group")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")
        field, rope = self._rope_dict
        rope_type = self.rope_type
        if rope_type == "yarn":
            _parse_yarn(field, rope, self.max_position_embeddings)
        elif rope_type != "default":
            raise ValueError(f"{field} type {rope_type!r} is not supported (only 'default' and 'yarn')")
        if self.kv_source_layer_ids is not None:
            ids = self.kv_source_layer_ids
            if not ids or ids[0] != 0 or sorted(set(ids)) != ids or ids[-1] >= self.num_hidden_layers:
                raise ValueError(
                    "kv_source_layer_ids must be strictly increasing layer indices starting at 0 "
                    f"and below num_hidden_layers, got {ids}")
        return self

    @property
    def _rope_dict(self) -> tuple[str, dict]:
        """(field name, dict) of the rope settings. As transformers reads them: `rope_scaling`
        (the name in released DeepSeek configs) wins whole over `rope_parameters` (the
        transformers 5 name), and "rope_type" over "type"."""
        if self.rope_scaling:
            return "rope_scaling", self.rope_scaling
        return "rope_parameters", self.rope_parameters or {}

    @property
    def rope_type(self) -> str:
        rope = self._rope_dict[1]
        return rope.get("rope_type", rope.get("type", "default"))

    @property
    def rope_base(self) -> float:
        rope = self._rope_dict[1]
        theta = rope.get("rope_theta")
        return float(self.rope_theta if theta is None else theta)

    @property
    def rope_yarn(self) -> YarnRope | None:
        if self.rope_type != "yarn":
            return None
        return _parse_yarn(*self._rope_dict, self.max_position_embeddings)

    @property
    def softmax_scale(self) -> float:
        """The attention's q.k scale, read by every attention path: 1/sqrt(qk_head_dim), and
        under YaRN DeepSeek's mscale_all_dim correction on top."""
        m = self.rope_yarn.softmax_mscale if self.rope_yarn else 1.0
        return self.qk_head_dim ** -0.5 * m * m  # this order of products is transformers', to the bit

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent KV entry: compressed kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def source_layers(self) -> list[int]:
        return list(self.kv_source_layer_ids) if self.kv_source_layer_ids is not None else list(
            range(self.num_hidden_layers))

    def source_slot(self, layer: int) -> int:
        """Index (into the global KV cache) of the latest KV-source layer at or before `layer`."""
        slot = 0
        for i, src in enumerate(self.source_layers):
            if src <= layer:
                slot = i
        return slot

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        data = {k: v for k, v in data.items() if k not in _IGNORED_HF_KEYS}
        try:
            return cls(**data)
        except ValidationError as e:
            raise ConfigError(f"invalid model config: {_describe(e)}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"model config not found: {path}")
        return cls.from_dict(json.loads(path.read_text()))

    def to_hf_dict(self) -> dict:
        d = self.model_dump(exclude_none=True)
        d.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                 num_key_value_heads=self.num_key_value_heads or self.num_attention_heads,
                 bos_token_id=0, eos_token_id=1)
        # One rope dict, under the name every transformers version reads; transformers 5 moves it
        # to rope_parameters itself.
        rope = self._rope_dict[1]
        d.pop("rope_parameters", None)
        if rope:
            d["rope_scaling"] = dict(rope)
        return d


class EngineConfig(BaseModel):
    """How the engine runs a model: cache sizes, batching, device."""

    @property
    def index_fp8(self) -> bool:
        """Whether the indexer's keys are stored as FP8 (index_cache_dtype, or kv_cache_dtype)."""
        return (self.index_cache_dtype or self.kv_cache_dtype) == "fp8_e4m3"

    model_config = ConfigDict(extra="forbid")

    device: str = Field("cpu", description="torch device, e.g. 'cpu' or 'cuda:0'")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    block_size: int = Field(16, gt=0, description="tokens per KV block")
    num_blocks: int = Field(512, gt=1, description="blocks in the global KV pool")
    max_num_seqs: int = Field(16, gt=0, description="running requests at most")
    max_num_batched_tokens: int = Field(512, gt=0, description="token budget of one step (chunked prefill)")
    max_model_len: int | None = Field(None, gt=0, description="prompt + output limit; default: the model's")
    enable_prefix_caching: bool = True
    replay_mode: Literal["bounded", "exact"] = Field(
        "bounded", description="window-KV rebuild after a prefix hit: last W tokens, or far enough to be exact")
    seed: int = 0
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto", description="global latent KV and indexer keys: the model dtype, or FP8 E4M3 with one scale per "
                            "token (half the bytes; quantised on write, dequantised in attention and scoring)")
    index_cache_dtype: Literal["auto", "fp8_e4m3"] | None = Field(
        None, description="the indexer's keys alone: None follows kv_cache_dtype; 'auto' keeps them in the model "
                          "dtype; 'fp8_e4m3' stores them as FP8 with one scale per token (as DeepSeek-V3.2's "
                          "indexer does) whatever the latent KV's dtype. At long context scoring them is the "
                          "largest read of a decode step.")
    index_topk_freq: int = Field(
        1, gt=0, description="the indexer scores and selects in every n-th layer (0, n, 2n, ...); the layers "
                             "between attend to the latest selection instead of their own (as vLLM's "
                             "IndexCache; DeepSeek-V4.1's reuse layers). 1: every layer selects, the model as "
                             "trained. An approximation that cuts the long-context indexer read by n.")
    index_topk_pattern: str | None = Field(
        None, description="per layer, 'F' (score and select) or 'S' (reuse the latest selection); replaces "
                          "index_topk_freq. One letter per layer, the first 'F'.")
    decode_kernels: bool = Field(
        True, description="steps where every sequence decodes one token use the paged decode kernels "
                          "(Triton on GPU, their torch references elsewhere) instead of the padded path")
    cuda_graphs: bool = Field(
        True, description="capture decode steps in CUDA graphs (CUDA only; with expert parallelism every rank "
                          "captures and replays the same graphs, engine/ep_step.py)")
    moe_gemm: Literal["auto", "triton", "grouped_mm"] = Field(
        "auto", description="routed-expert GEMMs on GPU: the fused Triton SwiGLU kernel (wideep_kernels/moe_gemm.py; "
                            "auto, measured faster on H200) or torch's grouped GEMM")
    expert_dtype: Literal["auto", "model", "fp8_e4m3"] = Field(
        "auto", description="routed experts' weights: 'fp8_e4m3' stores them as block FP8 (one fp32 scale per "
                            "block: the checkpoint's weight_block_size, else 128 x 128), loaded as stored from "
                            "an FP8 checkpoint or else quantized at start, and computed by the fused kernels: "
                            "half the bytes a decode step reads from them; 'model' keeps the model dtype (an "
                            "FP8 checkpoint's experts dequantized at load); 'auto' is 'fp8_e4m3' for an FP8 "
                            "checkpoint (DeepSeek's releases) on a GPU with the fused kernels, as vLLM and "
                            "SGLang serve them, else 'model'")
    expert_activations: Literal["auto", "model", "fp8_e4m3"] = Field(
        "auto", description="the routed experts' inputs, with FP8 experts: 'fp8_e4m3' quantizes each token's "
                            "inputs to both projections per 128 columns (DeepSeek-V3's own inference scheme) so "
                            "the products run on FP8 tensor cores, 3 mantissa bits for the activations; "
                            "'model' keeps them 16-bit; 'auto' quantizes them where an expert gets more than 16 "
                            "rows (prompt chunks, large decode batches: on the H200 the MoE kernels ran 1.1-1.5x "
                            "faster so) and keeps smaller decode batches' 16-bit (as fast there, more precise)")
    fuse_shared_experts: bool = Field(
        True, description="on GPU, compute the shared expert as one more slot of the routed experts' fused "
                          "kernels (where it has their shape) instead of as a separate MLP")
    decode_overlap: bool = Field(
        True, description="in CUDA-graph decode steps, run the indexer's top-k beside the query projections "
                          "and the shared experts beside the routed ones, on a second stream "
                          "(engine/streams.py)")
    async_scheduling: bool | None = Field(
        None, description="launch the next decode step before this one's tokens are read back (its input "
                          "tokens stay on the device), so the host's work between steps overlaps the GPU's; a "
                          "request that stops on a token costs one discarded row of the step after. None: on "
                          "GPU only (on CPU the step ahead runs before the outputs return, a step of latency "
                          "for nothing). With expert parallelism, where the group agrees on each step on the host: "
                          "GPU ranks of one host do (shared memory); a group across hosts steps one at a time.")
    warmup: bool = Field(
        True, description="on GPU, run a few short requests at start so kernel compilation and the first "
                          "CUDA graph capture do not delay the first users")
    cuda_graph_max_batch: int = Field(
        256, gt=0, description="largest decode batch replayed from a CUDA graph (at most max_num_seqs); a larger "
                               "one runs eagerly, several times slower. Graphs are captured on first use, one "
                               "per padded batch size (1, 2, 4, 8, then multiples of 16) and block-table width")
    cuda_graph_max_chunk: int = Field(
        2048, ge=0, description="most tokens of a step with prompt chunks (short prompts, the new turn of a "
                               "cached conversation, beside decoding sequences) replayed from a CUDA graph, each "
                               "token a row of the decode kernels; larger steps run eagerly. At most "
                               "max_num_batched_tokens; past 128 rows the graphs are padded to powers of two. "
                               "0: none")
    cuda_graph_min_tokens: int | None = Field(
        None, ge=0, description="decode and chunk graphs are captured for block tables of at least this many "
                                "tokens: every context below it shares one graph per batch size, captured at start "
                                "(warmup), so short contexts never meet a capture while serving (each costs a "
                                "stall of every running request). Past it, a graph per table width (four per "
                                "octave), captured on first use. None: the contexts that attend densely "
                                "(index_topk + sliding_window - 1) on a model with an indexer, else 2048; 0: a "
                                "graph per width from 256 tokens (engine/cuda_graphs.py)")
    cuda_graph_ahead_idle_s: float | None = Field(
        0.5, ge=0, description="after this many seconds with no request, the engine captures, one at a time, "
                               "the graph of the next table width of each batch size serving replayed (the width "
                               "its contexts grow into), so serving does not stall on it later; a request "
                               "arriving meanwhile waits for one capture at most (24-30 ms on the H200). The ranks "
                               "of a Wide-EP group capture together, after as many idle group steps (one each "
                               "5 ms). None: never")
    remote_kv_grace_s: float = Field(
        30.0, ge=0, description="after an abandoned KV transfer (failed, late, aborted), its reserved blocks "
                                "stay out of use this long, so a write still in flight cannot land in another "
                                "request's KV")

    @model_validator(mode="after")
    def _check_experts(self) -> "EngineConfig":
        if self.expert_dtype == "fp8_e4m3" and self.moe_gemm == "grouped_mm":
            raise ValueError("expert_dtype 'fp8_e4m3' is computed by the fused Triton kernels; moe_gemm "
                             "'grouped_mm' would dequantize every expert every step (use 'auto' or 'triton')")
        if self.expert_activations == "fp8_e4m3" and self.expert_dtype == "model":
            raise ValueError("expert_activations 'fp8_e4m3' multiplies FP8 weights: it needs FP8 experts, "
                             "which expert_dtype 'model' rules out")
        return self

    def fp8_experts(self, model: "ModelConfig") -> bool:
        """Whether the routed experts are stored as block FP8: expert_dtype, its 'auto' resolved
        against the checkpoint's quantization_config (and kept 16-bit where its blocks do not fit
        the kernels' k steps)."""
        if self.expert_dtype != "auto":
            return self.expert_dtype == "fp8_e4m3"
        quant = model.quantization_config
        if quant is None or not self.device.startswith("cuda") or self.moe_gemm == "grouped_mm":
            return False
        return fp8_block_cols_fit(quant.weight_block_size[1])

    @field_validator("index_topk_pattern")
    @classmethod
    def _check_pattern(cls, v: str | None) -> str | None:
        if v is not None:
            v = v.upper()
            if not v or set(v) - {"F", "S"}:
                raise ValueError("one letter per layer: 'F' (score and select) or 'S' (reuse)")
            if v[0] != "F":
                raise ValueError("the first layer has no selection to reuse: it must be 'F'")
        return v

    def index_scoring_layers(self, model: "ModelConfig") -> list[bool]:
        """Per layer of `model`, whether its indexer scores and selects (index_topk_freq/pattern)."""
        n = model.num_hidden_layers
        if self.index_topk_pattern is not None:
            if len(self.index_topk_pattern) != n:
                raise ConfigError(f"index_topk_pattern: {len(self.index_topk_pattern)} letters for a model of "
                                  f"{n} layers")
            scoring = [c == "F" for c in self.index_topk_pattern]
        else:
            scoring = [i % self.index_topk_freq == 0 for i in range(n)]
        if not all(scoring) and not model.index_topk:
            raise ConfigError("index_topk_freq / index_topk_pattern: this model has no indexer (index_topk unset)")
        return scoring


class ConfigError(ValueError):
    """A model or engine configuration problem, with the offending field named."""


_FP8_ONLY = ("only DeepSeek's block FP8 is supported: quant_method 'fp8', fmt 'e4m3', weight_block_size "
             "[rows, cols], weights dequantized at load")


_V3_ROUTING = "DeepSeek-V3/R1 routing only; DeepSeek-V2's softmax / greedy routing is not implemented"
_ROUTING_ONLY = {"scoring_func": _V3_ROUTING, "topk_method": _V3_ROUTING,
                 "moe_layer_freq": "every layer past first_k_dense_replace must be an MoE layer"}


def _describe(e: ValidationError) -> str:
    errors = e.errors()
    # Another method's own keys (bits, group_size, ...) would each be an "unknown key": noise
    # beside the one that matters, the method itself.
    method = ("quantization_config", "quant_method")
    if any(err["loc"][:2] == method for err in errors):
        errors = [err for err in errors if err["loc"][:1] != method[:1] or err["loc"][:2] == method]
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        if err["loc"] and err["loc"][0] in _ROUTING_ONLY and err["type"] == "literal_error":
            msg = f"{msg}, got {err['input']!r} ({_ROUTING_ONLY[err['loc'][0]]})"
        if err["loc"][:1] == ("quantization_config",):
            got = f", got {err['input']!r}" if err["type"] == "literal_error" else ""
            msg = f"{msg}{got} ({_FP8_ONLY})"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


# Named configs for tests and benchmarks. `tiny` runs on CPU in milliseconds per step;
# `bench` is a V4.1-style model of a few billion parameters for one H200.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
    ),
    "bench": dict(
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=768,
        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        n_shared_experts=1, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
        q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=10000.0,
        kv_source_layer_ids=[0, 4, 8, 12], sliding_window=128, index_topk=2048,
        index_n_heads=8, index_head_dim=64,
    ),
}
# `tiny` under YaRN, stretched 4x from 64 positions so short test prompts already reach past the
# original length; mscale/mscale_all_dim as DeepSeek-V2-Lite's, so the softmax scale changes.
PRESETS["tiny-yarn"] = dict(PRESETS["tiny"], max_position_embeddings=256, rope_scaling=dict(
    type="yarn", factor=4, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
    mscale=0.707, mscale_all_dim=0.707))
# The V4.1-style tiny variant used by the replay / sharing / indexer tests.
PRESETS["tiny-v4"] = dict(PRESETS["tiny"], kv_source_layer_ids=[0, 2], sliding_window=8,
                          index_topk=16, index_n_heads=2, index_head_dim=16)


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig.from_dict(dict(PRESETS[name], **overrides))
