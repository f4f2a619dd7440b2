"""Distributed Muon for FSDP2: whole matrices go to one owner rank each, not to every rank.

NS needs a full matrix, but FSDP2 (`fully_shard`) leaves each rank a block of rows. Instead of
all-gathering every matrix on every rank (world_size x the NS work), each row-sharded matrix
is assigned to one owner (greedy, largest first, balanced by NS cost); one all-to-all sends
every rank's rows of a matrix to its owner, the owner runs the (batched) NS on the matrices it
owns, and a second all-to-all returns each rank its rows of the finished update. This is the
scheme of Dion / Moonlight's distributed Muon, written on plain torch.distributed collectives
so that it runs on gloo (CPU) as well as NCCL.

Stacked experts [E, O, I] sharded on the expert dim need none of this: each rank holds whole
experts and orthogonalises them locally (muon.local_view).

Legend: R rows, C columns of a matrix; W world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["assign_owners", "row_range", "sharded_muon_updates"]


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows of `rank` under FSDP2's Shard(0) (torch.chunk semantics: ceil-sized chunks, last ones short or empty)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def assign_owners(costs: list[float], world: int) -> list[int]:
    """Greedy longest-processing-time assignment; identical on every rank (deterministic ties)."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[j] = r
        load[r] += costs[j]
    return owner


def _ns_cost(rows: int, cols: int) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return 2.0 * m * m * n + m**3


@torch.no_grad()
def sharded_muon_updates(
    opt: Any, group: dict[str, Any], sharded: list[tuple[Tensor, Tensor, Tensor]]
) -> list[Tensor]:
    """For each (DTensor param, local rows, local momentum-update rows): the local rows of
    -adjusted_lr * NS(full update), computed by the matrix's owner."""
    mesh = sharded[0][0].device_mesh
    if any(p.device_mesh != mesh for p, _, _ in sharded):
        raise ValueError("Muon: the row-sharded params of one param group must share one device mesh")
    if mesh.ndim != 1:
        raise ValueError(
            f"Muon: row-sharded matrices need a 1-D device mesh (plain FSDP2), got a {mesh.ndim}-D mesh"
        )
    pg = mesh.get_group()
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    shapes = [tuple(p.shape) for p, _, _ in sharded]
    for (_, p_loc, _), (R, C) in zip(sharded, shapes):
        lo, hi = row_range(R, rank, world)
        if tuple(p_loc.shape) != (hi - lo, C):
            raise ValueError(
                f"Muon: local shard {tuple(p_loc.shape)} of a {R}x{C} matrix is not torch.chunk-shaped"
            )
    owner = assign_owners([_ns_cost(R, C) for R, C in shapes], world)
    dtype = sharded[0][2].dtype
    device = sharded[0][2].device

    # 1. rows -> owner
    send = [
        torch.cat(
            [u.reshape(-1).to(dtype) for (_, _, u), o in zip(sharded, owner) if o == dst]
            or [_empty(dtype, device)]
        )
        for dst in range(world)
    ]
    mine = [j for j in range(len(sharded)) if owner[j] == rank]
    recv_sizes = [sum(_nrows(shapes[j][0], src, world) * shapes[j][1] for j in mine) for src in range(world)]
    recv = _exchange(send, recv_sizes, pg)

    # 2. owner: rebuild full matrices, batched NS, full scaled updates
    offsets = [0] * world
    full: dict[int, Tensor] = {}
    for j in mine:
        R, C = shapes[j]
        parts = []
        for src in range(world):
            n = _nrows(R, src, world) * C
            parts.append(recv[src][offsets[src] : offsets[src] + n].view(-1, C))
            offsets[src] += n
        full[j] = torch.cat(parts)
    updates = {j: torch.zeros(shapes[j], dtype=dtype, device=device) for j in mine}
    items: list[tuple[Tensor, Tensor]] = []
    for j in mine:
        items.extend(opt._logical_pieces(group, sharded[j][0], updates[j], full[j]))
    opt._orthogonalize_into(group, items)

    # 3. owner -> each rank's rows
    send_back = []
    for dst in range(world):
        chunks = []
        for j in mine:
            lo, hi = row_range(shapes[j][0], dst, world)
            chunks.append(updates[j][lo:hi].reshape(-1))
        send_back.append(torch.cat(chunks) if chunks else _empty(dtype, device))
    back_sizes = [
        sum(_nrows(shapes[j][0], rank, world) * shapes[j][1] for j in range(len(sharded)) if owner[j] == src)
        for src in range(world)
    ]
    back = _exchange(send_back, back_sizes, pg)
    out: list[Tensor] = [torch.empty(0)] * len(sharded)
    offsets = [0] * world
    for j in range(len(sharded)):
        src = owner[j]
        n = _nrows(shapes[j][0], rank, world) * shapes[j][1]
        out[j] = back[src][offsets[src] : offsets[src] + n].view(-1, shapes[j][1]).to(sharded[j][1].dtype)
        offsets[src] += n
    return out


def _nrows(rows: int, rank: int, world: int) -> int:
    lo, hi = row_range(rows, rank, world)
    return hi - lo


def _empty(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.zeros(0, dtype=dtype, device=device)


def _exchange(parts: list[Tensor], recv_sizes: list[int], pg: Any) -> list[Tensor]:
    """One variable-size all-to-all of flat buffers: parts[r] goes to rank r; returns what each rank sent us."""
    send = torch.cat(parts)
    out = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(
        out, send, output_split_sizes=recv_sizes, input_split_sizes=[t.numel() for t in parts], group=pg
    )
    return list(out.split(recv_sizes))
