"""The process group a training run joins, and the few collectives the loop needs.

Under torchrun (WORLD_SIZE > 1) `init_distributed` joins the group the environment describes:
gloo on CPU, NCCL on GPU. Every helper is a no-op in a single process, so the loop reads the same
either way. Full (unsharded) state dicts go through torch.distributed.checkpoint's state_dict API:
a collective whose result lands on rank 0, so a multi-process run's checkpoint loads, exports
and resumes like a single-process one.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


SINGLE_PROCESS = DistInfo()  # the default of every `info` argument (frozen, so shareable)


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    created = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        created = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, created)


def shutdown(info: DistInfo) -> None:
    """Leave the process group, and free what reference cycles kept of it (FSDP2 modules, device
    meshes) while the interpreter is alive: its gloo threads are then joined here, not in static
    destructors at exit, where one now and then aborted a rank after a finished run ("terminate
    called without an active exception", SIGABRT; docs/training.md)."""
    if info.initialized_here and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()


def all_reduce_scalar(value: float, op: str, info: DistInfo, device: torch.device) -> float:
    """`op`: "sum", "mean" or "max" over ranks (float64 on the wire)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t) / (info.world_size if op == "mean" else 1)


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def to_float(t: torch.Tensor) -> float:
    """A scalar that may be a DTensor (e.g. the grad norm of sharded parameters)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip by the global gradient norm; gradients may be DTensors on several meshes (FSDP2 x EP)."""
    from k2_model.parallelize import clip_grad_norm_

    return clip_grad_norm_(params, max_norm)


def full_model_state_dict(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU (a collective under FSDP2; the full dict lands on rank 0)."""
    if not info.enabled:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> dict[str, Any]:
    """The optimizer's whole state, keyed by parameter names under FSDP2 (a collective; the full
    dict lands on rank 0). Top-level extras of the optimizer's own state_dict (MuonClip's
    replicated QK-Clip statistics) are kept as they are."""
    if not info.enabled:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = dict(get_optimizer_state_dict(model, optimizer, options=opts))
    sd.update({k: v for k, v in optimizer.state_dict().items() if k not in ("state", "param_groups")})
    return sd


def load_full_model_state(model: nn.Module, model_sd: dict, info: DistInfo) -> None:
    """Inverse of `full_model_state_dict`: every rank passes the full dict and keeps its shards."""
    if not info.enabled:
        model.load_state_dict(model_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, optim_sd: dict, info: DistInfo
) -> None:
    """Inverse of `full_optimizer_state_dict` (every rank passes the full dict)."""
    if not info.enabled:
        optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    core = {k: optim_sd[k] for k in ("state", "param_groups")}
    set_optimizer_state_dict(
        model, optimizer, optim_state_dict=core, options=StateDictOptions(full_state_dict=True)
    )
    extras = {k: v for k, v in optim_sd.items() if k not in core}
    if extras:  # re-load the now sharded state together with the extras through the optimizer's API
        optimizer.load_state_dict({**optimizer.state_dict(), **extras})
