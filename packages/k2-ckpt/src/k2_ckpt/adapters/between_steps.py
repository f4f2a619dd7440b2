"""`BetweenStepsLoader`: a `ModuleAdapter` whose copies run between two steps of a live engine.

An inference engine that decodes in a loop must never run a step on half an update. This loader
stages as usual (the receiver has the tensors in its buffer already), then hands each copy and
the final commit to `call_between_steps(fn) -> Future` (k2-model's `EngineThread` and `Engine`
have one), and waits for it: requests already running keep their cache from the old weights, and
the next step sees only complete new weights. Used by `k2 serve` and k2-rl's rollout worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from k2_ckpt.adapters.module import ModuleAdapter


class BetweenStepsLoader:
    """A k2-ckpt `WeightLoader` over `module` whose loads run at a step boundary of an engine."""

    def __init__(self, module: nn.Module, call_between_steps: Callable[[Callable[[], Any]], Future]) -> None:
        self.inner = ModuleAdapter(module)
        self.call_between_steps = call_between_steps
        self.staging_pool = self.inner.staging_pool  # the receiver reuses staging buffers across updates

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.inner.validate(name, dtype, shape)

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = list(named)  # the tensors are staged already; only the copy waits for the boundary
        self.call_between_steps(lambda: self.inner.load_weights(named)).result()

    def post_load(self) -> None:
        self.call_between_steps(self.inner.post_load).result()

    def abort(self) -> None:  # the update was abandoned: only bookkeeping, no weights touched
        self.inner.abort()


__all__ = ["BetweenStepsLoader"]
