"""DeepSeekMoE: group-limited sigmoid routing, routed experts in physical slots, shared experts.

Routed experts live in physical slots (`w13`, `w2` stacked over slots) so that expert
parallelism and the load balancer can move and replicate them; `ExpertMap` translates
logical expert ids to slots. Every forward counts tokens per physical slot: the load
statistics the balancer reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wideep_kernels import triton_ok
from wideep_kernels.fp8_blocks import ExpertScales, act_group, dequantize_experts, fake_quantize_act, quantize_experts
from wideep_kernels.moe_align import AlignedPairs, align_pairs
from wideep_kernels.moe_gemm import act_fp8_pays, fused_experts, pick_config, token_major
from wideep_kernels.routing import fused_route, gate_fused_ok, gate_norm_applies, gate_parts_norm_triton, gate_parts_triton
from wideep_kernels.swiglu import silu_mul

from .config import ConfigError, ModelConfig, fp8_block_cols_fit
from .layers import MLP, DerivedWeight, NormInput
from .streams import Branch


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig, expert_map: "ExpertMap",
          slot_load: torch.Tensor | None = None, align: tuple[int, int] | None = None):
    """Router logits [T, E] (or [P, T, E] parts of them) -> (logical expert ids, weights,
    physical slots), each [T, k]; with `align` (num_slots, block_m; one token), a fourth result:
    the pairs' AlignedPairs layout for the expert kernels, made in the same launch.

    Sigmoid scores; the correction bias steers the choice but not the weights; only the
    best `topk_group` groups (by the sum of their two best biased scores) are eligible.
    `slot_load` counts the routed tokens per slot (the balancer's statistics). One fused
    kernel on GPU (wideep_kernels/routing.py).
    """
    if expert_map.log2phys.device != logits.device:
        expert_map.to(logits.device)
    routed = fused_route(logits, bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                         cfg.routed_scaling_factor, expert_map.log2phys, expert_map.num_replicas, slot_load, align)
    return routed if align is None else routed[:3] + (AlignedPairs(*routed[3]),)


def expert_fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    """The FP8 experts' block: the checkpoint's own (DeepSeek's FP8 releases: 128 x 128), else 128 x 128."""
    quant = cfg.quantization_config
    rows, cols = tuple(quant.weight_block_size) if quant is not None else (128, 128)
    if not fp8_block_cols_fit(cols):
        raise ConfigError(f"expert_dtype 'fp8_e4m3': the checkpoint's weight_block_size [{rows}, {cols}] needs "
                          "cols a power of two >= 16")
    return rows, cols


class ExpertMap:
    """Logical expert -> physical slot(s) of one MoE layer.

    `phys2log[s]` is the logical expert held by slot s. A logical expert with several
    replicas spreads its tokens over them by token index, so a hot expert's load splits.
    `max_replicas` fixes the width of `log2phys` whatever the placement, so that a new placement
    can be copied into the same tensors (update_), which captured CUDA graphs keep reading.
    """

    def __init__(self, phys2log: torch.Tensor, num_logical: int, max_replicas: int | None = None):
        phys2log = torch.as_tensor(phys2log, device="cpu").long()
        if phys2log.dim() != 1 or phys2log.min() < 0 or phys2log.max() >= num_logical:
            raise ValueError("phys2log must be a 1-D list of expert ids in range")
        held = torch.bincount(phys2log, minlength=num_logical)
        if int(held.min()) == 0:
            missing = torch.nonzero(held == 0).flatten().tolist()
            raise ValueError(f"experts with no physical slot: {missing}")
        self.phys2log = phys2log
        self.num_replicas = held
        max_rep = int(held.max())
        if max_replicas is not None:
            if max_rep > max_replicas:
                raise ValueError(f"an expert has {max_rep} slots, more than max_replicas {max_replicas}")
            max_rep = max_replicas
        log2phys = torch.full((num_logical, max_rep), -1, dtype=torch.long, device="cpu")
        fill = [0] * num_logical
        for slot, e in enumerate(phys2log.tolist()):
            log2phys[e, fill[e]] = slot
            fill[e] += 1
        self.log2phys = log2phys

    def update_(self, phys2log: torch.Tensor) -> None:
        """Take a new placement in place (same slots, same experts, same max_replicas)."""
        new = ExpertMap(phys2log, len(self.num_replicas), self.log2phys.shape[1])
        for mine, theirs in ((self.phys2log, new.phys2log), (self.num_replicas, new.num_replicas),
                             (self.log2phys, new.log2phys)):
            if mine.shape != theirs.shape:
                raise ValueError(f"a placement of shape {list(theirs.shape)} cannot replace {list(mine.shape)}")
            mine.copy_(theirs)

    def to(self, device) -> "ExpertMap":
        self.phys2log = self.phys2log.to(device)
        self.num_replicas = self.num_replicas.to(device)
        self.log2phys = self.log2phys.to(device)
        return self

    def slots_for(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, k] -> physical slots [T, k]."""
        if self.log2phys.device != ids.device:
            self.to(ids.device)
        tok = torch.arange(ids.shape[0], device=ids.device)[:, None]
        replica = tok % self.num_replicas[ids]
        return self.log2phys[ids, replica]


def _grouped_mm_ok(xs: torch.Tensor, w13: torch.Tensor) -> bool:
    # torch's grouped GEMM wants 16-byte-aligned rows; on CUDA it needs bf16 and Hopper or newer.
    if not hasattr(torch, "_grouped_mm") or _GROUPED_MM_DISABLED:
        return False
    align = 16 // xs.element_size()
    if xs.shape[-1] % align or w13.shape[1] % (2 * align):
        return False
    if xs.is_cuda:
        return xs.dtype == torch.bfloat16 and torch.cuda.get_device_capability(xs.device)[0] >= 9
    return True


_GROUPED_MM_DISABLED = False


class MoE(nn.Module):
    """One MoE layer. `local_phys2log` names the logical expert of each physical slot this
    process holds (all experts, in order, without expert parallelism); with expert
    parallelism `ep` (engine.ep.ExpertParallel) routes tokens to the slots of every rank.
    `fp8_block`: the routed experts are allocated as block FP8 from the start, for a loader to
    fill from an FP8 checkpoint as it stands (no 16-bit copy of them is ever made)."""

    def __init__(self, cfg: ModelConfig, local_phys2log: list[int] | None = None,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        # Block FP8 experts (quantize_experts): the scales of w13 / w2, and the shared expert's FP8 copy.
        self.fp8_block: tuple[int, int] | None = None
        self._shared_fp8 = DerivedWeight()
        self.cfg = cfg
        self.local_phys2log = list(local_phys2log) if local_phys2log is not None else list(range(cfg.n_routed_experts))
        num_slots = len(self.local_phys2log)
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = nn.Linear(h, cfg.n_routed_experts, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        # Physical expert slots: gate and up projections fused.
        if fp8_block is None:
            self.w13 = nn.Parameter(torch.empty(num_slots, 2 * i, h))
            self.w2 = nn.Parameter(torch.empty(num_slots, h, i))
        else:
            rows, cols = fp8_block
            fp8 = torch.float8_e4m3fn
            self._hold_fp8(torch.empty(num_slots, 2 * i, h, dtype=fp8), torch.empty(num_slots, h, i, dtype=fp8),
                           torch.empty(num_slots, 2 * -(-i // rows), -(-h // cols), dtype=torch.float32),
                           torch.empty(num_slots, -(-h // rows), -(-i // cols), dtype=torch.float32), fp8_block)
        self.shared_experts = MLP(h, i * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.expert_map = ExpertMap(self.local_phys2log, cfg.n_routed_experts) \
            if local_phys2log is None else None
        self.ep = None
        self.gemm = "auto"  # EngineConfig.moe_gemm, set by the model runner
        self.layer_index = -1  # position among the model's MoE layers, set by the model
        self.overlap = False  # EngineConfig.decode_overlap, set by the model runner
        self.fuse_shared = True  # EngineConfig.fuse_shared_experts, set by the model runner
        # the experts' inputs beside FP8 weights, set by the model runner (model_runner.expert_activations):
        # 'model' 16-bit, 'fp8_e4m3' quantized, 'auto' quantized where it pays (act_fp8_pays)
        self.activations = "model"
        self.register_buffer("slot_load", torch.zeros(num_slots, dtype=torch.long), persistent=False)
        self._gate_fp32 = DerivedWeight()  # router logits are computed in fp32

    def forward(self, x: torch.Tensor | NormInput) -> torch.Tensor:
        """[T, H]: in x's dtype, or from the fused kernels the fp32 sum before its rounding, which
        the decoder layer's next add_rms_norm does (one launch fewer). For a NormInput (one
        token, see takes_norm) the router's launch normalises the row too."""
        w = self.gate.weight
        logits = None
        if isinstance(x, NormInput):
            logits, x = gate_parts_norm_triton(x.x, x.residual, x.norm.weight, x.norm.eps, w, x.stream)
        shared_slot = self._shared_slot(x)
        shared = None
        if self.shared_experts is not None and shared_slot is None:
            # The shared experts need nothing from the router: in a captured decode step they run
            # beside it and the routed experts, joined only where their output is added.
            shared = Branch(self.overlap, self.shared_experts, x)
        if self.ep is not None:
            # Every rank routes the whole group's rows itself (engine/ep.py): no logits here.
            out = self.ep.moe_forward(self, x, shared_slot)
            return out if shared is None else out + shared.join()
        if logits is None:
            logits = self.router_logits(x)
        bias = self.gate.e_score_correction_bias
        align = self._align_in_router(x)
        routed = route(logits, bias, self.cfg, self.expert_map, self.slot_load, align)
        # The sum may come back in fp32: the decoder layer's next norm rounds it (add_rms_norm).
        return self.experts(x, routed[2], routed[1], add=None if shared is None else shared.join,
                            shared=shared_slot, fp32_out=True, aligned=routed[3] if align else None)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits [T, E], or for decode batches partial ones that the route kernel sums
        (one launch)."""
        w = self.gate.weight
        if gate_fused_ok(x):
            return gate_parts_triton(x, w)
        return F.linear(x.float(), self._gate_fp32.get([w], w.float))

    def route_to(self, x: torch.Tensor, log2phys: torch.Tensor, num_replicas: torch.Tensor,
                 real: torch.Tensor | None = None):
        """(weights, slots), each [T, k], of rows x routed through a map of the caller's (expert
        parallelism: this rank's slots, -1 for the others'), in one launch with the routing; rows
        that are not `real` ([T] bools: padding) get slot -1 in the same launch, which also counts
        the pairs of this rank's slots into slot_load."""
        cfg = self.cfg
        _, weights, slots = fused_route(self.router_logits(x), self.gate.e_score_correction_bias, cfg.n_group,
                                        cfg.topk_group, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                        cfg.routed_scaling_factor, log2phys, num_replicas, self.slot_load, real=real)
        return weights, slots

    # block FP8 experts ------------------------------------------------------------------
    def quantize_experts(self, block: tuple[int, int], slots_at_once: int = 8) -> None:
        """Store the routed experts as block FP8 (wideep_kernels/fp8_blocks.py): one byte a weight plus
        one fp32 scale per block, computed by the fused kernels without a dequantized copy.
        A few slots at a time, so the fp32 working copy stays small beside the weights."""
        if self.fp8_block is not None:
            raise ValueError("the experts are already FP8")
        parts = [quantize_experts(self.w13.data[i:i + slots_at_once], self.w2.data[i:i + slots_at_once], block)
                 for i in range(0, self.w13.shape[0], slots_at_once)]
        self._hold_fp8(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                       torch.cat([p[2].w13 for p in parts]), torch.cat([p[2].w2 for p in parts]), block)

    def _hold_fp8(self, w13, w2, w13_scale, w2_scale, block) -> None:
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.register_buffer("w13_scale", w13_scale)
        self.register_buffer("w2_scale", w2_scale)
        self.fp8_block = tuple(block)

    @property
    def scales(self) -> ExpertScales | None:
        return None if self.fp8_block is None else ExpertScales(self.w13_scale, self.w2_scale, self.fp8_block)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Everything held per physical slot (dim 0): what the balancer moves with an expert."""
        weights = [self.w13.data, self.w2.data]
        return weights if self.fp8_block is None else weights + [self.w13_scale, self.w2_scale]

    def _dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """w13, w2 in `dtype` for the paths without the fused kernels (FP8 dequantized per call)."""
        if self.fp8_block is None:
            return self.w13, self.w2
        w13, w2 = dequantize_experts(self.w13, self.w2, self.scales)
        return w13.to(dtype), w2.to(dtype)

    def takes_norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> bool:
        """Whether forward() can take its input's norm as a NormInput: one token, where the
        router's partial logits run as a kernel (gate_parts_norm_triton). Not with expert
        parallelism, which routes the gathered rows of the whole group instead."""
        return self.ep is None and gate_norm_applies(x, residual, norm.weight, self.gate.weight)

    def _align_in_router(self, x: torch.Tensor) -> tuple[int, int] | None:
        """(num_slots, block_m) when the routing kernel should lay out the pairs for the expert
        kernels itself (one token: its alignment launch saved), else None."""
        num_slots = self.w13.shape[0]
        if x.shape[0] != 1 or not self._fused_ok(x) or num_slots < self.cfg.num_experts_per_tok:
            return None
        k = self.cfg.num_experts_per_tok
        return num_slots, pick_config(k, num_slots, self.w13.dtype, self.act_fp8(k)).block_m

    def act_fp8(self, num_pairs: int) -> bool:
        """Whether the experts' inputs for this many (token, slot) pairs are quantized to FP8."""
        if self.fp8_block is None or self.activations == "model":
            return False
        return self.activations == "fp8_e4m3" or act_fp8_pays(num_pairs, self.w13.shape[0])

    def _fused_ok(self, x: torch.Tensor) -> bool:
        return self.gemm != "grouped_mm" and triton_ok(x)

    def _shared_slot(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared expert's weights, for the fused kernels to compute as one more slot (its
        weight read in the routed experts' two launches, not in three launches of its own), where
        they can: one shared expert of the routed experts' shape. With expert parallelism each rank
        computes it for its own rows only (fused_experts' shared_rows)."""
        if not self.fuse_shared or self.shared_experts is None or not self._fused_ok(x):
            return None
        w13, w2 = self.shared_experts.expert_weights()
        if (w13.shape, w2.shape) != (self.w13.shape[1:], self.w2.shape[1:]):
            return None
        if self.fp8_block is not None:
            # the fused slot reads an FP8 copy of the shared expert, in the routed experts' blocks
            return self._shared_fp8.get([w13, w2], lambda: quantize_experts(w13, w2, self.fp8_block))
        if (w13.dtype, w2.dtype) != (self.w13.dtype, self.w2.dtype):
            return None
        return w13, w2

    def experts(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                add=None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                fp32_out: bool = False, aligned: AlignedPairs | None = None) -> torch.Tensor:
        """Routed experts for tokens x [T, H] routed to local slots [T, k] with weights [T, k]
        (already counted in slot_load by the router), plus `add` (the shared experts' output, or
        a function returning it, called only when the sum needs it), plus the `shared` expert
        computed as one more slot (its weights from _shared_slot). `fp32_out`, `aligned`: see
        fused_experts."""
        # token-major pairs: the fused kernels derive each pair's token (p // k) themselves
        return self.expert_pairs(x, None, slots.flatten(), weights.flatten(), count=False, add=add, shared=shared,
                                 fp32_out=fp32_out, aligned=aligned)

    def expert_pairs(self, x: torch.Tensor, token_of: torch.Tensor | None, slot_of: torch.Tensor,
                     weight_of: torch.Tensor, count: bool = True, add=None,
                     shared: tuple[torch.Tensor, torch.Tensor] | None = None, fp32_out: bool = False,
                     aligned: AlignedPairs | None = None, live_pairs: int | None = None,
                     shared_rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Sum over (token, local slot, weight) pairs of weight * expert(x[token]), as [T, H]
        (token_of None: token-major pairs, as wideep_kernels/moe_gemm.py takes them), plus `add` when
        given (the fused path adds it in the same launch that rounds the fp32 sum).
        Pairs are sorted by slot: one grouped GEMM per projection where torch has it (no host
        sync, no per-expert launches), else one matmul pair per slot.
        `live_pairs`: pairs of slot -1 are dropped (expert parallelism: another rank's), about this
        many are not (see fused_experts); they are neither computed by the fused kernels nor counted.
        `shared_rows` (first, end): the tokens the `shared` slot takes (see fused_experts)."""
        fused = self._fused_ok(x)
        act_fp8 = self.act_fp8(slot_of.numel() if live_pairs is None else live_pairs)
        if shared is not None and not fused:
            raise ValueError("a shared expert slot needs the fused kernels (see _shared_slot)")
        num_slots = self.w13.shape[0]
        if count and fused and aligned is None:
            # the pairs' layout holds their counts: one launch to add them
            block_m = pick_config(slot_of.numel() if live_pairs is None else live_pairs, num_slots, self.w13.dtype,
                                  act_fp8).block_m
            aligned = align_pairs(slot_of, num_slots, block_m)
            self.slot_load += aligned.counts
        elif count:
            # scatter_add, not bincount: bincount on CUDA reads the max back to the host (a sync
            # per layer); slot -1 counts into a bin in front that is cut off
            self.slot_load += torch.zeros(num_slots + 1, dtype=torch.long, device=x.device).scatter_add_(
                0, slot_of + 1, torch.ones_like(slot_of))[1:]
        if fused:
            return fused_experts(x, self.w13, self.w2, token_of, slot_of, weight_of, add=add, shared=shared,
                                 fp32_out=fp32_out, aligned=aligned, scales=self.scales, act_fp8=act_fp8,
                                 live_pairs=live_pairs, shared_rows=shared_rows)
        if live_pairs is not None:
            # The paths below compute every pair: a dropped one as slot 0 weighing nothing (no
            # compaction, which would read its size back to the host).
            weight_of = torch.where(slot_of >= 0, weight_of, 0)
            slot_of = slot_of.clamp(min=0)
        counts = torch.zeros(num_slots, dtype=torch.long, device=x.device).scatter_add_(
            0, slot_of, torch.ones_like(slot_of))
        order = slot_of.argsort(stable=True)
        token_of = token_major(token_of, x, slot_of)[order]
        xs = x[token_of]
        w13, w2 = self._dense_weights(x.dtype)
        if _grouped_mm_ok(xs, w13):
            offs = counts.cumsum(0).to(torch.int32)
            gate_up = torch._grouped_mm(self._act_in(xs, act_fp8), w13.transpose(1, 2), offs=offs)
            y = torch._grouped_mm(self._act_in(silu_mul(gate_up), act_fp8), w2.transpose(1, 2), offs=offs)
        else:
            y = self._experts_loop(xs, counts, w13, w2, act_fp8)
        y = y * weight_of[order].to(y.dtype)[:, None]
        out = torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))
        return out if add is None else out + (add() if callable(add) else add)

    def _experts_loop(self, xs: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, act_fp8: bool) -> torch.Tensor:
        y = torch.empty_like(xs)
        start = 0
        for slot, n in enumerate(counts.tolist()):
            if n:
                gate_up = F.linear(self._act_in(xs[start:start + n], act_fp8), w13[slot])
                y[start:start + n] = F.linear(self._act_in(silu_mul(gate_up), act_fp8), w2[slot])
                start += n
        return y

    def _act_in(self, rows: torch.Tensor, act_fp8: bool) -> torch.Tensor:
        """A projection's input as the fused kernels multiply it: FP8 activations take their
        quantized values."""
        if not act_fp8:
            return rows
        return fake_quantize_act(rows, act_group(self.fp8_block)).to(rows.dtype)

    def take_load(self) -> torch.Tensor:
        """Tokens per physical slot since the last call (the balancer's load window)."""
        load = self.slot_load.clone()
        self.slot_load.zero_()
        return load
