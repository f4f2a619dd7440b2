"""Warmup-stable-decay (WSD) learning-rate schedule, as K2 pre-training used it.

K2: 500 warmup steps, constant 2e-4 for 10T tokens, then cosine decay to 2e-5
(min_lr_ratio = 0.1) over 5.5T tokens. The factor multiplies every param group's base lr:
    step <  W           (step + 1) / W                 linear warmup, reaches 1 at step W - 1
    W <= step < W + S   1                              stable
    then                r + (1 - r) * (1 + cos(pi * t)) / 2,  t = (step - W - S) / D in [0, 1]
    step >= W + S + D   r                              held at the floor
"""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["wsd_factor", "wsd_schedule"]


def wsd_factor(
    step: int, warmup_steps: int, stable_steps: int, decay_steps: int, min_lr_ratio: float
) -> float:
    """The WSD multiplier of the base lr at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    step -= warmup_steps
    if step < stable_steps:
        return 1.0
    step -= stable_steps
    if decay_steps == 0 or step >= decay_steps:
        return min_lr_ratio
    t = step / decay_steps
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def wsd_schedule(
    optimizer: Optimizer,
    warmup_steps: int,
    stable_steps: int,
    decay_steps: int,
    min_lr_ratio: float = 0.1,
    last_epoch: int = -1,
) -> LambdaLR:
    """A `LambdaLR` applying `wsd_factor` to every param group (Muon and AdamW groups alike)."""
    for name, v in (
        ("warmup_steps", warmup_steps),
        ("stable_steps", stable_steps),
        ("decay_steps", decay_steps),
    ):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"wsd_schedule: {name} must be a non-negative int, got {v!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"wsd_schedule: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")

    def factor(step: int) -> float:
        return wsd_factor(step, warmup_steps, stable_steps, decay_steps, min_lr_ratio)

    return LambdaLR(optimizer, factor, last_epoch=last_epoch)
