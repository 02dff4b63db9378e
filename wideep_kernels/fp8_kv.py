"""Per-token FP8 (E4M3) storage for latent KV.

Each token's latent row gets its own fp32 scale so that one outlier token cannot crush the
precision of its neighbours; attention kernels multiply the scale back in as they load keys.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 (fn variant) magnitude
# An all-zero row would give scale 0 and 0/0 on quantise; any positive floor keeps it exact zeros.
MIN_AMAX = 1e-12


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] float8_e4m3fn, scale [...] float32) with x ~= q * scale.

    scale = max(amax(|row|), MIN_AMAX) / 448, so every row uses the full E4M3 range.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_kv: (q.float() * scale) cast to dtype."""
    return (q.float() * scale.float()[..., None]).to(dtype)
