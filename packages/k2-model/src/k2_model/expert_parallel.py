"""Expert parallelism: routed experts split over an `ep` mesh dim, tokens moved by all-to-all.

The mesh is torchtitan's for dp_shard x EP: world = dp_shard = dp_shard_mod_ep * ep, ranks
laid out row-major, so an EP group is `ep` consecutive ranks. Each rank of an EP group holds
E / ep whole experts (a DTensor Shard(0) on the `ep` dim); FSDP2 then shards those over
`dp_shard_mod_ep` (done by k2_model.parallelize).

One MoE layer's routed experts under EP (hooks around `RoutedExperts`, the layer is unchanged):
  dispatch  the rows the router grouped by global expert are sent to the rank owning that
            expert: per-expert counts first (all_to_all_single, E ints), then the rows with
            variable split sizes (no capacity, no token dropped); the received rows, ordered
            (source rank, local expert), are regrouped to (local expert, source rank) so the
            local experts run as one grouped GEMM;
  combine   the inverse regroup and the reverse all-to-all bring each row back to its token.
Both all-to-alls are autograd functions whose backward is the transposed all-to-all.

Legend: N rows on this rank (tokens x top-k), M rows received, D hidden, E experts,
E_l = E / ep local experts, P ep group size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "COMM",
    "CommCounter",
    "EPMesh",
    "ExpertParallel",
    "build_ep_mesh",
    "local_tensor",
]


@dataclass
class CommCounter:
    """Bytes this process put into expert-parallel all-to-alls (forward and backward).

    `sent_bytes` counts rows to other ranks, `local_bytes` rows a rank keeps (all_to_all_single
    copies them too, but they never cross a link); `count_bytes` the per-expert count exchange."""

    sent_bytes: int = 0
    local_bytes: int = 0
    count_bytes: int = 0
    calls: int = 0
    per_layer: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.sent_bytes = self.local_bytes = self.count_bytes = self.calls = 0
        self.per_layer.clear()

    @property
    def total_bytes(self) -> int:
        return self.sent_bytes + self.local_bytes + self.count_bytes


COMM = CommCounter()  # process-wide; benchmarks and tests reset and read it


def local_tensor(t: Tensor) -> Tensor:
    """The local part of a DTensor (differentiable), a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass(frozen=True)
class EPMesh:
    """The 2-D mesh ("dp_shard_mod_ep", "ep") and its 1-D views; `dp_shard` is all ranks."""

    root: Any
    dp_shard: Any
    dp_shard_mod_ep: Any
    ep: Any


def build_ep_mesh(world: int, ep: int, device_type: str) -> EPMesh:
    from torch.distributed.device_mesh import init_device_mesh

    if ep < 1 or world % ep:
        raise ValueError(f"--ep {ep} must divide the number of processes {world}")
    root = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    return EPMesh(root, root._flatten("dp_shard"), root["dp_shard_mod_ep"], root["ep"])


def _count(rows_by_rank: list[int], row_bytes: int, me: int) -> None:
    COMM.calls += 1
    for r, n in enumerate(rows_by_rank):
        if r == me:
            COMM.local_bytes += n * row_bytes
        else:
            COMM.sent_bytes += n * row_bytes


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _count(in_splits, math.prod(x.shape[1:]) * x.element_size(), dist.get_rank(group))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    return out


class _AllToAll(torch.autograd.Function):
    """Variable-split all_to_all_single; backward sends the gradients back along the same rows."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


class ExpertParallel:
    """Dispatch/combine hooks of one RoutedExperts module on an EP process group.

    `install(experts)` turns its stacked weights into DTensors sharded on the expert dim over
    `ep_mesh` (every rank must have initialised them alike, as for FSDP) and registers the
    hooks; `RoutedExperts.forward` then sees only local rows and local experts."""

    def __init__(self, ep_mesh: Any) -> None:
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self._pending: list[tuple[list[int], list[int], Tensor]] = []

    def install(self, experts: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor, Shard

        E = experts.num_experts
        if E % self.size:
            raise ValueError(
                f"--ep {self.size} must divide n_routed_experts={E} (each rank holds whole experts)"
            )
        n = E // self.size
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(experts, name)
            mine = full.detach()[self.rank * n : (self.rank + 1) * n].clone()
            dt = DTensor.from_local(mine, self.mesh, [Shard(0)], run_check=False)
            setattr(experts, name, torch.nn.Parameter(dt, requires_grad=full.requires_grad))
        experts.num_local_experts = n
        experts.register_forward_pre_hook(self._dispatch)
        experts.register_forward_hook(self._combine)

    # ---------------------------------------------------------------- hooks
    def _dispatch(self, module: torch.nn.Module, args: tuple) -> tuple[Tensor, Tensor]:
        x_ND, offsets_E = args
        P = self.size
        El = offsets_E.numel() // P
        with torch.no_grad():
            counts_E = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1).long())
            recv_PEl = torch.empty_like(counts_E)
            COMM.count_bytes += counts_E.numel() * counts_E.element_size()
            dist.all_to_all_single(recv_PEl, counts_E, group=self.group)
            recv_PEl = recv_PEl.view(P, El)
            in_splits = counts_E.view(P, El).sum(1).tolist()
            out_splits = recv_PEl.sum(1).tolist()
            # received rows come ordered (source, local expert); regroup by (local expert, source)
            seg_M = torch.repeat_interleave(torch.arange(P * El, device=x_ND.device), recv_PEl.reshape(-1))
            key_M = (seg_M % El) * P + seg_M // El
            perm_M = torch.sort(key_M, stable=True).indices
            offsets_El = torch.cumsum(recv_PEl.sum(0), 0).to(torch.int32)
        x_MD = _AllToAll.apply(x_ND, out_splits, in_splits, self.group)
        self._pending.append((out_splits, in_splits, perm_M))
        return x_MD[perm_M], offsets_El

    def _combine(self, module: torch.nn.Module, args: tuple, y_MD: Tensor) -> Tensor:
        out_splits, in_splits, perm_M = self._pending.pop()
        y_recv = torch.empty_like(y_MD).index_copy(0, perm_M, y_MD)  # undo the regroup
        return _AllToAll.apply(y_recv, in_splits, out_splits, self.group)
