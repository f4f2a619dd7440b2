"""Parallelism applied to a K2ForCausalLM from outside the model, as torchtitan does per model.

The layers know nothing about sharding: `parallelize(model, ...)` (or its parts) wraps them.

- `apply_activation_checkpointing(model, mode)`: "full" recomputes every decoder layer in backward,
  "selective" every other layer (torchtitan's layer-frequency selective AC), "none" turns it off.
  Expert-load counts stay exact (the recompute does not count tokens twice; see DecoderLayer).
- `apply_fsdp(model, param_dtype, reduce_dtype)`: FSDP2 `fully_shard` per decoder layer and at the
  root (parameters sharded on dim 0, so the stacked routed experts [E, I, D] split by expert). With
  bf16 compute the policy is K2's: bf16 parameters in forward/backward, fp32 master weights and
  fp32 gradient reduction. Needs an initialised default process group.
"""

from __future__ import annotations

import torch
from torch import nn

from k2_model.model import DecoderLayer, K2ForCausalLM

AC_MODES = ("none", "full", "selective")


def apply_activation_checkpointing(model: K2ForCausalLM, mode: str = "full") -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    every = {"none": 0, "full": 1, "selective": 2}[mode]
    for i, layer in enumerate(_decoder_layers(model)):
        layer.activation_checkpointing = bool(every) and i % every == 0


def apply_fsdp(
    model: K2ForCausalLM, param_dtype: torch.dtype = torch.float32, reduce_dtype: torch.dtype = torch.float32
) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def parallelize(
    model: K2ForCausalLM,
    *,
    data_parallel: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    activation_checkpointing: str = "none",
) -> K2ForCausalLM:
    """Activation checkpointing first, then FSDP2 around the (checkpointing) layers."""
    apply_activation_checkpointing(model, activation_checkpointing)
    if data_parallel:
        apply_fsdp(model, param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return model


def _decoder_layers(model: nn.Module) -> list[DecoderLayer]:
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no k2_model DecoderLayer to parallelize")
    return layers


__all__ = ["AC_MODES", "apply_activation_checkpointing", "apply_fsdp", "parallelize"]
