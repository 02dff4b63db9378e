"""Small building blocks of the DeepSeek model."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from wideep_kernels.gemv import linear
from wideep_kernels.rmsnorm import add_rms_norm, rms_norm
from wideep_kernels.rope import apply_rope
from wideep_kernels.swiglu import silu_mul

from .config import YarnRope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual), the add in the same
        launch. One fused kernel on GPU (wideep_kernels/rmsnorm.py); its reference is the expression
        weight * rms_norm(x in fp32).to(x.dtype)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


class NormInput(NamedTuple):
    """An RMSNorm left for the batch-1 kernel that reads its output: that kernel normalises the
    row itself (wideep_kernels/gemv.py norm_gemv_triton, wideep_kernels/routing.py gate_parts_norm_triton), one
    launch fewer a norm. Made only where the next layer said it takes it (`takes_norm`)."""
    x: torch.Tensor
    residual: torch.Tensor | None
    norm: RMSNorm
    stream: torch.Tensor  # x + residual (x without one), written by the kernel that normalises


def defer_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
               consumer) -> tuple[torch.Tensor | NormInput, torch.Tensor]:
    """(norm's output, the residual stream) as RMSNorm gives them, or, where `consumer` (a
    module with `takes_norm(x, residual, norm)`) computes the norm in its own first kernel, a
    NormInput in place of the output."""
    takes = getattr(consumer, "takes_norm", None)
    if takes is not None and takes(x, residual, norm):
        stream = x if residual is None else torch.empty_like(residual)
        return NormInput(x, residual, norm, stream), stream
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class DerivedWeight:
    """A weight computed from parameters (concatenated, cast) and cached until one of them is
    replaced (load, .to()) or, with `track_writes`, written in place. At decode batch sizes
    every GEMM is a small, launch-bound kernel, so one GEMM over concatenated weights beats
    several. A rebuilt value of the same shape is copied into the old one: CUDA graphs
    captured earlier keep reading the right memory."""

    def __init__(self, track_writes: bool = True):
        self.track_writes = track_writes
        self._key, self._value = None, None

    def _identity(self, sources: list[torch.Tensor]) -> tuple:
        return tuple((t.data_ptr(), t.dtype) + ((t._version,) if self.track_writes else ()) for t in sources)

    def get(self, sources: list[torch.Tensor], build):
        if self._key != self._identity(sources):
            value = build()
            if isinstance(self._value, torch.Tensor) and isinstance(value, torch.Tensor) \
                    and (value.shape, value.dtype, value.device) == (self._value.shape, self._value.dtype,
                                                                    self._value.device):
                with torch.inference_mode(False), torch.no_grad():
                    self._value.copy_(value)
            else:
                self._value = value
            self._key = self._identity(sources)  # build may rebind the sources (fused_linear does)
        return self._value


def fused_weight(mods: list[nn.Linear], cache: DerivedWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mods' weights (and biases) concatenated, cached in `cache` (a
    DerivedWeight(track_writes=False)). The modules' parameters then become views of the
    concatenation, so it costs no memory (a copy of every such weight would be gigabytes per GPU
    for DeepSeek-V3) and a later write into one of them lands in it; a replaced one makes a new one."""
    def build():
        # Plain tensors even when the first call runs under inference mode: the parameters
        # must stay writable (weight loading, .to()) outside it.
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([m.weight for m in mods])
            bias = None
            if any(m.bias is not None for m in mods):
                bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                                  for m in mods])
            start = 0
            for m in mods:
                rows = slice(start, start + m.out_features)
                m.weight.data = weight[rows]
                if m.bias is not None:
                    m.bias.data = bias[rows]
                start += m.out_features
        return weight, bias
    return cache.get([m.weight for m in mods], build)


def fused_linear(x: torch.Tensor, mods: list[nn.Linear], cache: DerivedWeight, split: bool = True):
    """[m(x) for m in mods] from one GEMM over the mods' concatenated weights (fused_weight);
    with split=False, the GEMM's output itself (the mods' outputs side by side)."""
    weight, bias = fused_weight(mods, cache)
    out = linear(x, weight, bias)
    return list(out.split([m.out_features for m in mods], dim=-1)) if split else out


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers and the shared experts."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self._gate_up = DerivedWeight(track_writes=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = fused_linear(x, [self.gate_proj, self.up_proj], self._gate_up, split=False)
        return self.down_proj(silu_mul(gate_up))  # one launch on GPU (wideep_kernels/swiglu.py)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate and up stacked [2I, H], down [H, I]): the layout of one routed-expert slot."""
        return fused_weight([self.gate_proj, self.up_proj], self._gate_up)[0], self.down_proj.weight


class Rotary:
    """Rotary position embedding over the rope part of q and k.

    DeepSeek checkpoints lay the rotary dims out as interleaved pairs (x0, x1), (x2, x3)...
    (`rope_interleave`); otherwise as two halves. Only q.k products matter, so the output
    layout need not match any other implementation's.

    With `yarn` (YaRN, every released DeepSeek config) the frequencies are stretched and the
    tables scaled (`YarnRope.table_scale`); every consumer (the q rope, the latent's rope key in
    wideep_kernels/latent.py) reads these tables, so none computes YaRN itself. The softmax half of
    YaRN is ModelConfig.softmax_scale.
    """

    def __init__(self, dim: int, base: float, interleave: bool, max_pos: int, device,
                 yarn: YarnRope | None = None):
        if yarn is None:
            inv_freq, self.table_scale = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        else:
            inv_freq, self.table_scale = yarn_frequencies(dim, base, yarn), yarn.table_scale
        self.inv_freq = inv_freq.to(device)
        self.interleave = interleave
        self._cache_len = 0
        self._extend(max(max_pos, 1))

    def _extend(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        if self.table_scale != 1.0:
            self.cos, self.sin = self.cos * self.table_scale, self.sin * self.table_scale
        self._cache_len = n

    def ensure(self, max_position: int) -> None:
        """Grow the tables on the host's word, so the forward never syncs to check."""
        if max_position >= self._cache_len:
            self._extend(2 * max_position + 1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for these positions (all below the length given to ensure()); looked
        up once per forward and shared by every layer."""
        return self.cos[positions], self.sin[positions]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., dim] rotated by the [T, dim/2] tables (one fused kernel on GPU,
        wideep_kernels/rope.py, whose reference defines the maths)."""
        return apply_rope(x, cos, sin, self.interleave)


def yarn_frequencies(dim: int, base: float, yarn: YarnRope) -> torch.Tensor:
    """YaRN's inverse frequencies [dim/2], fp32 and in the same operation order as transformers'
    (so the tables match it bit for bit). Pairs that turn beta_fast times or more within the
    original context saw every angle in training and keep their frequency; pairs that turn fewer
    than beta_slow times are slowed by `factor`, as position interpolation does, so that long
    positions land on angles seen in training; a linear ramp over the pairs between."""
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    original = 1.0 / wavelengths
    interpolated = 1.0 / (yarn.factor * wavelengths)

    def pair_turning(turns: float) -> float:
        # the (fractional) pair index whose frequency turns `turns` times over the original context
        return dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = pair_turning(yarn.beta_fast), pair_turning(yarn.beta_slow)
    if yarn.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a zero-width ramp: a step at lo
    slowed = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    kept = 1 - slowed
    return interpolated * (1 - kept) + original * kept
