"""Parallelism applied to a K2ForCausalLM from outside the model, as torchtitan does per model.

The layers know nothing about sharding: `parallelize(model, ...)` (or its parts) wraps them.

- `apply_activation_checkpointing(model, mode)`: "full" recomputes every decoder layer in backward,
  "selective" every other layer (torchtitan's layer-frequency selective AC), "none" turns it off.
  Expert-load counts stay exact (the recompute does not count tokens twice; see DecoderLayer).
- `apply_fsdp(model, param_dtype, reduce_dtype)`: FSDP2 `fully_shard` per decoder layer and at the
  root (parameters sharded on dim 0, so the stacked routed experts [E, I, D] split by expert). With
  bf16 compute the policy is K2's: bf16 parameters in forward/backward, fp32 master weights and
  fp32 gradient reduction. Needs an initialised default process group.
- `apply_expert_parallel(model, ep)`: torchtitan's dp_shard x EP mesh (k2_model.expert_parallel):
  routed experts split over `ep` ranks (E / ep whole experts each) and FSDP-sharded over
  dp_shard / ep; everything else FSDP over all ranks. Tokens reach their experts by all-to-all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from k2_model.model import DecoderLayer, K2ForCausalLM
from k2_model.moe import MoE

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


def apply_expert_parallel(
    model: K2ForCausalLM,
    ep: int,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> Any:
    """Expert parallelism over `ep` ranks composed with FSDP2 over all ranks; returns the mesh.

    Experts: DTensors Shard(0) on the `ep` dim, then `fully_shard` over dp_shard_mod_ep (the
    unit's spmd placement is (_StridedShard(0), Shard(0)): every rank keeps whole experts). An
    expert's local gradient already sums the loss terms of every rank of its EP group (the
    backward all-to-all brings them), so its reduce-scatter divides by the world size, not by
    dp_shard_mod_ep: the same average over all ranks the other parameters get.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from k2_model.expert_parallel import ExpertParallel, build_ep_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"--ep {ep} needs torch.distributed (run under torchrun)")
    world = dist.get_world_size()
    E = model.config.n_routed_experts
    if ep < 1 or world % ep:
        raise ValueError(f"--ep {ep} must divide the number of processes {world}")
    if E % ep:
        raise ValueError(f"--ep {ep} must divide n_routed_experts={E} (each rank holds whole experts)")
    device_type = model.lm_head.weight.device.type
    mesh = build_ep_mesh(world, ep, device_type)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    gloo = dist.get_backend() == "gloo"
    for layer in _decoder_layers(model):
        if isinstance(layer.mlp, MoE):
            ExpertParallel(mesh.ep).install(layer.mlp.experts)
            experts = fully_shard(layer.mlp.experts, mesh=mesh.dp_shard_mod_ep, mp_policy=mp)
            experts.set_gradient_divide_factor(float(world))
            # gloo has no PREMUL_SUM: sum, then divide. (Not on a 1-rank dp_shard_mod_ep: there
            # FSDP copies the gradient divided by the factor and would divide a second time.)
            if gloo and world // ep > 1:
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(layer, mesh=mesh.dp_shard, mp_policy=mp)
    fully_shard(model, mesh=mesh.dp_shard, mp_policy=mp)
    return mesh


def parallelize(
    model: K2ForCausalLM,
    *,
    data_parallel: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    activation_checkpointing: str = "none",
    ep: int = 1,
) -> K2ForCausalLM:
    """Activation checkpointing first, then FSDP2 (with `ep` > 1: FSDP2 x EP) around the layers."""
    apply_activation_checkpointing(model, activation_checkpointing)
    if ep > 1:
        if not data_parallel:
            raise ValueError(f"--ep {ep} needs several processes (run under torchrun)")
        apply_expert_parallel(model, ep, param_dtype=compute_dtype, reduce_dtype=torch.float32)
    elif data_parallel:
        apply_fsdp(model, param_dtype=compute_dtype, reduce_dtype=torch.float32)
    return model


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` that also takes gradients on several device meshes.

    Under FSDP2 x EP the routed experts' gradients live on the 2-D (dp_shard_mod_ep, ep) mesh and
    the rest on dp_shard; DTensor ops cannot mix meshes, so each mesh's norm is reduced to a full
    value on its own and the squares are summed. One mesh (or none) takes torch's own path."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    if len(by_mesh) <= 1:
        return float(_full(torch.nn.utils.clip_grad_norm_(params, max_norm)))
    total = sum(float(_full(torch.nn.utils.get_total_norm(g, 2.0))) ** 2 for g in by_mesh.values()) ** 0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:  # as torch: scale only when the norm exceeds max_norm
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
    return total


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _decoder_layers(model: nn.Module) -> list[DecoderLayer]:
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no k2_model DecoderLayer to parallelize")
    return layers


__all__ = [
    "AC_MODES",
    "apply_activation_checkpointing",
    "apply_expert_parallel",
    "apply_fsdp",
    "clip_grad_norm_",
    "parallelize",
]
