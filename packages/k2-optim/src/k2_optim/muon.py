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
from typing import Any, NamedTuple

import torch
from k2_kernels.dispatch import cpu_has_native_bf16
from torch import Tensor
from torch.optim import Optimizer

from .newton_schulz import Coeffs, NSWorkspace, newton_schulz, resolve_ns_schedule

__all__ = [
    "Muon",
    "adjust_lr",
    "cpu_has_native_bf16",
    "declare_fused",
    "default_ns_dtype",
    "local_view",
    "ns_dtype_name",
]


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


# Param groups hold the NS dtype by name: torch.distributed.checkpoint (multi-process train states)
# cannot store a torch.dtype value, and a name survives JSON and old state dicts alike.
_NS_DTYPE_NAMES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def ns_dtype_name(ns_dtype: torch.dtype | str | None) -> str:
    """The name a param group stores for `ns_dtype`: "auto" (None or "auto"), or a torch dtype's
    name ("float32", "bfloat16", ...; "fp32"/"bf16" are accepted as aliases)."""
    if ns_dtype is None or ns_dtype == "auto":
        return "auto"
    if isinstance(ns_dtype, torch.dtype):
        return str(ns_dtype).removeprefix("torch.")
    if isinstance(ns_dtype, str):
        dt = _NS_DTYPE_NAMES.get(ns_dtype, getattr(torch, ns_dtype, None))
        if isinstance(dt, torch.dtype) and dt.is_floating_point:
            return str(dt).removeprefix("torch.")
    raise ValueError(
        f"ns_dtype must be a floating torch.dtype, its name, 'fp32', 'bf16', None or 'auto', got {ns_dtype!r}"
    )


def default_ns_dtype(device: torch.device, ns_dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The NS compute dtype for `ns_dtype` on `device`.

    None / "auto" (the default): the dtype the machine runs fastest: bf16 on CUDA and on CPUs
    whose bf16 GEMMs are native (AVX512-BF16 / AMX: there bf16 NS measured ~2x faster than fp32),
    fp32 on other CPUs (AVX2, where bf16 is emulated and ~30x slower). `K2_NATIVE_BF16=0|1`
    overrides the CPU probe. A torch.dtype (or its name) is used as given.
    """
    name = ns_dtype_name(ns_dtype)
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_native_bf16():
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


# Bytes of one NS chunk's input on CPU: the iteration's X, A = X X^T and the products of a chunk stay
# in the caches across its steps. Measured on 2 cores (384 bf16 matrices of 128x256): one batch of all
# of them 124 ms, chunks of 32 (2 MiB) 67 ms, bit-identical (the matrices are independent).
NS_CHUNK_BYTES = 2 << 20


def ns_chunk_matrices(device: torch.device, dtype: torch.dtype, out_dim: int, in_dim: int) -> int:
    """How many [out_dim, in_dim] matrices one batched NS call takes: cache-sized chunks on CPU,
    everything at once elsewhere (a GPU wants the largest batch)."""
    if device.type != "cpu":
        return 1 << 62
    per_matrix = out_dim * in_dim * torch.empty((), dtype=dtype).element_size()
    return max(1, NS_CHUNK_BYTES // per_matrix)


class _Piece(NamedTuple):
    """One logical matrix (or a stack of them, [..., O, I]) on its way through Muon: `dest` takes
    the update; `grad` is the gradient, or the finished update when `buf` is None; `buf` is the
    momentum buffer."""

    dest: Tensor
    grad: Tensor
    buf: Tensor | None


def _advance_momentum(group: dict[str, Any], grad: Tensor, buf: Tensor | None) -> Tensor:
    """Advance the momentum buffer; return the tensor to orthogonalise (torch.optim.Muon's EMA
    form: never the buffer itself when nesterov, the buffer read-only otherwise)."""
    if buf is None:
        return grad
    mu = group["momentum"]
    buf.lerp_(grad, 1 - mu)
    return grad.lerp(buf, mu) if group["nesterov"] else buf


def _batch_view(t: Tensor | None) -> Tensor | None:
    """t [..., O, I] as a [B, O, I] view of the same storage, or None when no view exists."""
    if t is None or t.ndim == 3:
        return t
    try:
        return t.view(-1, *t.shape[-2:])
    except RuntimeError:  # a non-viewable layout (e.g. a slice of a >3-D tensor)
        return None


def _pack_segments(bucket: list[_Piece], chunk: int) -> list[list[_Piece]]:
    """Split every piece of one shape into [n, O, I] view segments of at most `chunk` matrices and
    pack consecutive small ones together, so that each list is one NS call. A piece without batch
    views goes whole, as one [B, O, I] segment whose dest takes the result by reshape."""
    groups: list[list[_Piece]] = []
    current: list[_Piece] = []
    filled = 0
    for piece in bucket:
        views = [_batch_view(t) for t in piece]
        if any(v is None for v, t in zip(views, piece) if t is not None):
            assert piece.buf is None, "momentum of a piece without batch views is advanced by the caller"
            groups.append([_Piece(piece.dest, piece.grad.reshape(-1, *piece.grad.shape[-2:]), None)])
            continue
        d3, g3, b3 = views
        for start in range(0, g3.shape[0], chunk):
            seg = _Piece(
                d3[start : start + chunk],
                g3[start : start + chunk],
                None if b3 is None else b3[start : start + chunk],
            )
            n = seg.grad.shape[0]
            if current and filled + n > chunk:
                groups.append(current)
                current, filled = [], 0
            current.append(seg)
            filled += n
    if current:
        groups.append(current)
    return groups


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
        ns_dtype: NS compute dtype; None / "auto" (default) = what the machine runs fastest:
            bf16 on CUDA and on CPUs with native bf16 GEMMs (AVX512-BF16 / AMX), fp32 on other
            CPUs; or a torch.dtype (torch.float32 for reduction-order-stable updates,
            torch.bfloat16 for torch.optim.Muon's exact update).
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
        ns_dtype = ns_dtype_name(ns_dtype)  # validates; groups store the name (see _NS_DTYPE_NAMES)
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

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "ns_dtype" in param_group:  # a group's own dtype, stored by name like the default
            param_group = {**param_group, "ns_dtype": ns_dtype_name(param_group["ns_dtype"])}
        super().add_param_group(param_group)

    @property
    def _ns_workspace(self) -> NSWorkspace:
        """CPU buffers the chunked NS reuses step after step (not part of the state)."""
        ws = self.__dict__.get("_k2_ns_workspace")
        if ws is None:
            ws = self.__dict__["_k2_ns_workspace"] = NSWorkspace()
        return ws

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

    def _momentum_buffers(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """(local grad, local momentum buffer) of p; the buffer is created at the first step.
        DTensors (FSDP2): the local shards; the buffer keeps the param's placement."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        return _local(grad), _local(state["momentum_buffer"])

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd = group["lr"], group["weight_decay"]
        local: list[_Piece] = []  # whole logical matrices at hand: momentum, NS and update chunk by chunk
        sharded: list[tuple[Tensor, Tensor, Tensor]] = []  # (param, local param rows, local update rows)
        for p in params:
            g_loc, buf_loc = self._momentum_buffers(p)
            p_loc, _, whole = local_view(p, g_loc)
            if whole:  # plain tensor, replicated DTensor, or stacked experts sharded on the expert dim
                local.extend(
                    _Piece(d, g, b)
                    for (d, g), (_, b) in zip(
                        self._logical_pieces(group, p, p_loc, g_loc),
                        self._logical_pieces(group, p, p_loc, buf_loc),
                    )
                )
            else:  # rows of a matrix are spread over ranks: gathered to one owner for NS
                sharded.append((p, p_loc, _advance_momentum(group, g_loc, buf_loc)))
                if wd != 0:  # decoupled weight decay with the unadjusted lr, before the update
                    p_loc.mul_(1 - lr * wd)
        self._orthogonalize_into(group, local, decay=True)
        if sharded:
            from .distributed import sharded_muon_updates

            for (_, p_loc, _), upd in zip(sharded, sharded_muon_updates(self, group, sharded)):
                p_loc.add_(upd)

    def _orthogonalize_into(self, group: dict[str, Any], items: list, decay: bool = False) -> None:
        """For every item, dest += -adjusted_lr(shape) * NS(update): batched NS per shape, in
        cache-sized chunks on CPU (see `ns_chunk_matrices`).

        An item is (dest, update) or a `_Piece` (dest, grad, momentum buffer) whose momentum is
        advanced chunk by chunk right before its NS. With `decay`, dest first takes the decoupled
        weight decay (W *= 1 - lr * wd, as torch.optim.Muon). Working chunk by chunk keeps a chunk's
        momentum, NS and update in the caches instead of streaming whole parameters several times.
        """
        schedule = resolve_ns_schedule(group["ns_coefficients"], group["ns_steps"])
        keep = 1 - group["lr"] * group["weight_decay"] if decay else 1.0
        buckets: dict[tuple, list[_Piece]] = defaultdict(list)
        for item in items:
            piece = item if isinstance(item, _Piece) else _Piece(item[0], item[1], None)
            if piece.buf is not None and any(_batch_view(t) is None for t in piece):
                piece = _Piece(
                    piece.dest, _advance_momentum(group, piece.grad, piece.buf), None
                )  # rare layouts
            ns_dtype = default_ns_dtype(piece.grad.device, group["ns_dtype"])
            buckets[(tuple(piece.grad.shape[-2:]), piece.grad.device, ns_dtype)].append(piece)
        for (shape, device, ns_dtype), bucket in buckets.items():
            out_dim, in_dim = shape
            alpha = -adjust_lr(group["lr"], group["adjust_lr_fn"], out_dim, in_dim)
            chunk = ns_chunk_matrices(device, ns_dtype, out_dim, in_dim)
            ws = self._ns_workspace if device.type == "cpu" else None  # CUDA: the caching allocator
            for segments in _pack_segments(bucket, chunk):
                updates = [_advance_momentum(group, seg.grad, seg.buf) for seg in segments]
                U_BOI = updates[0] if len(updates) == 1 else torch.cat(updates)
                O_BOI = newton_schulz(U_BOI, schedule, dtype=ns_dtype, eps=group["eps"], workspace=ws)
                offset = 0
                for seg in segments:
                    n = seg.grad.shape[0]
                    if keep != 1.0:
                        seg.dest.mul_(keep)
                    seg.dest.add_(O_BOI[offset : offset + n].reshape(seg.dest.shape), alpha=alpha)
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
