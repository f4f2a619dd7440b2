"""Muon: momentum, then Newton-Schulz orthogonalisation, per logical matrix, batched by shape.

Tensor legend:
    E  experts (leading batch dims of a stacked parameter, flattened)
    B  logical matrices of one shape in one bucket (all experts of all same-shape params)
    O  output rows of one logical matrix,  I  input columns

Update rule (Moonlight / K2 Algorithm 1, written in torch.optim.Muon's EMA form, which
differs from M = mu M + G only by the constant factor (1 - mu) that NS normalises away):
    buf = lerp(buf, g, 1 - mu);  u = lerp(g, buf, mu) if nesterov else buf
    O   = NS(u) ;  W = W * (1 - lr * wd) - lr * 0.2 * sqrt(max(O, I)) * O
The "unit" is the logical matrix: each expert of a stacked [E, O, I] weight, and each
declared piece of a fused weight (gate and up stored in one tensor) is orthogonalised and
RMS-matched on its own. Matrices of the same shape are stacked and go through one
batched NS call, so there is no Python loop over experts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .newton_schulz import Coeffs, newton_schulz, resolve_ns_schedule

__all__ = ["Muon", "adjust_lr", "cpu_has_native_bf16", "default_ns_dtype", "declare_fused", "local_view"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_view(p: Tensor, u: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(local param storage, local update, whether the local part holds whole matrices).

    Plain tensors and replicated DTensors hold whole matrices; a DTensor sharded on a leading
    batch dim (stacked experts [E, O, I] under FSDP2's Shard(0), or under FSDP2 x expert
    parallelism, whose 2-D placement is (_StridedShard(0), Shard(0))) holds whole experts; a 2-D
    weight sharded on its rows does not, and goes through the gather-to-owner path.
    """
    if not hasattr(p, "to_local"):
        return p, u, True
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = p.placements
    for pl in placements:
        if not isinstance(pl, (Shard, _StridedShard, Replicate)):
            raise ValueError(f"Muon: DTensor placement {pl} is not supported (Shard or Replicate only)")
    shard_dims = [pl.dim % p.ndim for pl in placements if isinstance(pl, (Shard, _StridedShard))]
    whole = all(d < p.ndim - 2 for d in shard_dims)
    strided = any(isinstance(pl, _StridedShard) for pl in placements)
    if not whole and (strided or len(shard_dims) != 1 or shard_dims[0] != p.ndim - 2 or p.ndim != 2):
        raise ValueError(
            f"Muon: DTensor of shape {tuple(p.shape)} with placements {placements}: only row sharding "
            "(Shard(0)) of 2-D matrices or sharding of the leading (expert) dim of stacked matrices is supported"
        )
    return p.to_local(), u if not hasattr(u, "to_local") else u.to_local(), whole


_FUSED_ATTR = "_k2_muon_split"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX tiles)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private probes moved: assume the conservative answer
        return False


def default_ns_dtype(device: torch.device, ns_dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The NS compute dtype for `ns_dtype` on `device`.

    None (the default): bf16 on CUDA, fp32 on CPU — the issue's contract, made for AVX2-only CPUs
    where bf16 is emulated (~30x slower than fp32). "auto": bf16 wherever bf16 GEMMs are native,
    i.e. CUDA and CPUs with AVX512-BF16/AMX (there bf16 NS measured ~2x faster than fp32).
    A torch.dtype is used as given.
    """
    if isinstance(ns_dtype, torch.dtype):
        return ns_dtype
    if ns_dtype not in (None, "auto"):
        raise ValueError(f"ns_dtype must be a torch.dtype, None or 'auto', got {ns_dtype!r}")
    if device.type == "cuda":
        return torch.bfloat16
    if ns_dtype == "auto" and device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def adjust_lr(lr: float, adjust_lr_fn: str | None, out_dim: int, in_dim: int) -> float:
    """Per-matrix learning rate: "match_rms_adamw" = lr * 0.2 * sqrt(max(O, I)) (Moonlight, K2);
    "original" = lr * sqrt(max(1, O / I)) (Keller Jordan); None = lr."""
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(out_dim, in_dim))
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, out_dim / in_dim))
    if adjust_lr_fn is None or adjust_lr_fn == "none":
        return lr
    raise ValueError(f"adjust_lr_fn must be 'match_rms_adamw', 'original' or None, got {adjust_lr_fn!r}")


def declare_fused(param: Tensor, sizes: Sequence[int], dim: int = -2) -> Tensor:
    """Mark `param` as several logical matrices concatenated along `dim` (-2: rows, -1: cols).

    E.g. a gate+up weight [E, 2F, D]: `declare_fused(w, (F, F))`. Muon then orthogonalises
    (and RMS-matches) gate and up separately. Equivalent to a param group with
    `split_sizes=(F, F)`; the attribute does not survive re-wrapping of the parameter (e.g.
    FSDP2's fully_shard), the group key does.
    """
    _check_split(tuple(param.shape), tuple(sizes), dim, "declare_fused")
    setattr(param, _FUSED_ATTR, (tuple(int(s) for s in sizes), dim))
    return param


def _check_split(shape: tuple[int, ...], sizes: tuple[int, ...], dim: int, where: str) -> None:
    if len(shape) < 2:
        raise ValueError(f"{where}: parameter of shape {shape} is not a matrix")
    if dim not in (-2, -1):
        raise ValueError(f"{where}: split dim must be -2 (rows) or -1 (columns), got {dim}")
    if sum(sizes) != shape[dim] or any(s <= 0 for s in sizes):
        raise ValueError(
            f"{where}: split sizes {sizes} must be positive and sum to shape[{dim}]={shape[dim]}"
        )


class Muon(Optimizer):
    """Muon for matrices (2-D or stacked [..., out, in]); equal to
    `torch.optim.Muon(..., adjust_lr_fn="match_rms_adamw")` when `ns_dtype=torch.bfloat16`.

    Args:
        params: parameters or param groups. A group may set `split_sizes` (and `split_dim`,
            default -2) to declare that each of its params is several logical matrices.
        lr: learning rate (the AdamW-equivalent lr when adjust_lr_fn="match_rms_adamw").
        weight_decay: decoupled weight decay, applied with the unadjusted lr.
        momentum, nesterov: EMA momentum as in torch.optim.Muon.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: "keller" (default), "polar_express", one (a, b, c) or a list of them.
        ns_dtype: NS compute dtype; None = bf16 on CUDA, fp32 on CPU; "auto" = bf16 wherever
            bf16 GEMMs are native (CUDA, CPUs with AVX512-BF16/AMX); or a torch.dtype.
        eps: floor of the Frobenius norm in the NS normalisation.
        adjust_lr_fn: "match_rms_adamw" (default, K2), "original" or None.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str | Coeffs | Sequence[Coeffs] = "keller",
        ns_dtype: torch.dtype | str | None = None,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "match_rms_adamw",
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        resolve_ns_schedule(ns_coefficients, ns_steps)  # validate early, with a clear message
        adjust_lr(1.0, adjust_lr_fn, 1, 1)
        default_ns_dtype(torch.device("cpu"), ns_dtype)  # validate
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
            split_sizes=None,
            split_dim=-2,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._validate_group(group)

    # Subclasses (MuonClip) route non-Muon groups elsewhere.
    def _is_muon_group(self, group: dict[str, Any]) -> bool:
        return True

    def _validate_group(self, group: dict[str, Any]) -> None:
        if not self._is_muon_group(group):
            return
        for i, p in enumerate(group["params"]):
            if p.ndim < 2:
                raise ValueError(
                    f"Muon: param {i} of a Muon group has shape {tuple(p.shape)}; Muon takes matrices "
                    "([out, in] or stacked [..., out, in]). Use AdamW (or MuonClip, which routes them) "
                    "for biases, norms and other 1-D parameters."
                )
            split = self._split_of(group, p)
            if split is not None:
                _check_split(tuple(p.shape), split[0], split[1], f"Muon param {i}")

    @staticmethod
    def _split_of(group: dict[str, Any], p: Tensor) -> tuple[tuple[int, ...], int] | None:
        if group.get("split_sizes"):
            return tuple(group["split_sizes"]), int(group.get("split_dim", -2))
        return getattr(p, _FUSED_ATTR, None)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if self._is_muon_group(group):
                self._muon_group_step(group)
        return loss

    def _momentum_update(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """Advance p's momentum buffer; return the tensor to orthogonalise (never the buffer
        itself when nesterov; the buffer read-only otherwise)."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        mu = group["momentum"]
        # DTensors (FSDP2): work on the local shards; the buffer keeps the param's placement
        g_loc, buf_loc = _local(grad), _local(buf)
        buf_loc.lerp_(g_loc, 1 - mu)
        return g_loc.lerp(buf_loc, mu) if group["nesterov"] else buf_loc

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd = group["lr"], group["weight_decay"]
        local: list[tuple[Tensor, Tensor]] = []  # (dest view, update piece), full matrices at hand
        sharded: list[tuple[Tensor, Tensor, Tensor]] = []  # (param, local param rows, local update rows)
        for p in params:
            u = self._momentum_update(group, p)
            p_loc, u_loc, whole = local_view(p, u)
            if whole:  # plain tensor, replicated DTensor, or stacked experts sharded on the expert dim
                local.extend(self._logical_pieces(group, p, p_loc, u_loc))
            else:  # rows of a matrix are spread over ranks: gathered to one owner for NS
                sharded.append((p, p_loc, u_loc))
        # decoupled weight decay with the unadjusted lr, before the update (as torch.optim.Muon)
        if wd != 0:
            for p in params:
                local_view(p, p)[0].mul_(1 - lr * wd)
        self._orthogonalize_into(group, local)
        if sharded:
            from .distributed import sharded_muon_updates

            for (_, p_loc, _), upd in zip(sharded, sharded_muon_updates(self, group, sharded)):
                p_loc.add_(upd)

    def _orthogonalize_into(self, group: dict[str, Any], items: list[tuple[Tensor, Tensor]]) -> None:
        """dest += -adjusted_lr(shape) * NS(piece) for every (dest, piece); one batched NS per shape."""
        schedule = resolve_ns_schedule(group["ns_coefficients"], group["ns_steps"])
        buckets: dict[tuple, list[tuple[Tensor, Tensor]]] = defaultdict(list)
        for dest, piece in items:
            ns_dtype = default_ns_dtype(piece.device, group["ns_dtype"])
            buckets[(tuple(piece.shape[-2:]), piece.device, ns_dtype)].append((dest, piece))
        for (shape, _device, ns_dtype), bucket in buckets.items():
            out_dim, in_dim = shape
            if len(bucket) == 1:
                U_BOI = bucket[0][1].reshape(-1, out_dim, in_dim)
            else:
                U_BOI = torch.cat([piece.reshape(-1, out_dim, in_dim) for _, piece in bucket])
            O_BOI = newton_schulz(U_BOI, schedule, dtype=ns_dtype, eps=group["eps"])
            alpha = -adjust_lr(group["lr"], group["adjust_lr_fn"], out_dim, in_dim)
            offset = 0
            for dest, piece in bucket:
                n = piece.numel() // (out_dim * in_dim)
                dest.add_(O_BOI[offset : offset + n].reshape(dest.shape), alpha=alpha)
                offset += n

    def _logical_pieces(
        self, group: dict[str, Any], p: Tensor, dest: Tensor, u: Tensor
    ) -> list[tuple[Tensor, Tensor]]:
        """(view of dest, matching slice of the update) for each logical matrix of param p."""
        split = self._split_of(group, p)
        if split is None:
            return [(dest, u)]
        sizes, dim = split
        return list(zip(dest.split(sizes, dim=dim), u.split(sizes, dim=dim)))
