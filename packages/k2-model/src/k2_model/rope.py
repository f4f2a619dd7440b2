"""Rotary position embedding with YaRN, in DeepSeek's interleaved checkpoint layout.

Shape legend: B batch, S sequence, H heads, R rotary head dim (qk_rope_head_dim), R2 = R // 2.

The checkpoints store each rotary head with its pairs interleaved, (x0, x1), (x2, x3), ...; pair j
rotates by frequency j. We rotate the even/odd slices directly and write the result as
[rotated evens, rotated odds] (as transformers 5.x does): q and k get the same permutation, so
every q.k dot product equals the interleaved one, and no weight needs reordering.
"""

from __future__ import annotations

import math

import torch
from k2_kernels.reference import rope_interleaved
from torch import Tensor

from k2_model.config import K2Config


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(config: K2Config, device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies [R2] (fp32) and the factor cos/sin are multiplied by (YaRN attention factor)."""
    dim = config.qk_rope_head_dim
    base = float(config.rope_theta)
    pos_freqs_R2 = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    rs = config.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs_R2, 1.0
    factor = float(rs["factor"])
    orig_max = float(rs["original_max_position_embeddings"])
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32.0
    beta_slow = rs.get("beta_slow") or 1.0

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp_R2 = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_R2 = 1 - ramp_R2
    inv_freq_R2 = (1.0 / (factor * pos_freqs_R2)) * ramp_R2 + (1.0 / pos_freqs_R2) * extrapolation_R2
    return inv_freq_R2, float(attention_factor)


def rope_cos_sin(
    inv_freq_R2: Tensor, position_ids_BS: Tensor, attention_factor: float
) -> tuple[Tensor, Tensor]:
    """cos, sin [B, S, R2] in fp32 for the given positions."""
    freqs_BSR2 = position_ids_BS.to(torch.float32).unsqueeze(-1) * inv_freq_R2
    return freqs_BSR2.cos() * attention_factor, freqs_BSR2.sin() * attention_factor


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs of the last dim of x ([..., R]); cos/sin broadcast to [..., R2].

    Returns [..., R] laid out as [rotated evens, rotated odds].
    """
    return rope_interleaved(x, cos.to(x.dtype), sin.to(x.dtype))  # k2-kernels' definition, shared
