"""QK-Clip: rescale the query/key weights of every attention head whose max logit exceeded tau.

The QK-Clip protocol (duck typed; k2-optim never imports a model package). A model provides

    attention_max_logits() -> Tensor float32 [L, H]   per layer and head, the max pre-softmax
                                                      logit (after the softmax scale, over the
                                                      query-key pairs the mask allows) over the
                                                      training-mode forwards since the last reset
    reset_attention_max_logits() -> None
    qk_clip_layers() -> list[dict]                    one entry per row of attention_max_logits():
        {"name": str, "num_heads": int, "spans": [span, ...]}
        span = {"param": Tensor, "stride": int, "start": int, "length": int, "power": float}:
        for head h, rows [h*stride + start, h*stride + start + length) of `param` (a weight or
        bias, head rows on dim 0) are multiplied by gamma_h ** power, gamma_h = tau / S_h.

Which rows, and which power:
    MLA (K2)  q_b_proj.weight (q_proj.weight without q-LoRA), stride qk_nope + qk_rope:
                q-nope rows power 0.5, q-rope rows power 1.0;
              kv_b_proj.weight, stride qk_nope + v_head_dim: k-nope rows power 0.5.
              Never listed: the value rows of kv_b_proj and kv_a_proj_with_mqa (the rotary key
              shared by all heads: scaling it would change heads that did not overflow).
              Logit_h = qn.kn + qr.kr  ->  sqrt(g) sqrt(g) qn.kn + g qr.kr = g * logit_h.
    MHA       query and key rows (and biases) power 0.5.
    GQA       query rows (and bias) power 1.0; the key head is shared by several query heads.

Tensor legend: L layers, H heads, R rows of a parameter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "QKClipLayer",
    "QKClipSpan",
    "apply_qk_clip",
    "clip_factors",
    "normalize_layers",
    "reduce_max_logits",
    "supports_qk_clip",
]


@dataclass
class QKClipSpan:
    param: Tensor
    stride: int
    start: int
    length: int
    power: float


@dataclass
class QKClipLayer:
    name: str
    num_heads: int
    spans: list[QKClipSpan] = field(default_factory=list)


def supports_qk_clip(model: Any) -> bool:
    return all(
        callable(getattr(model, m, None))
        for m in ("attention_max_logits", "reset_attention_max_logits", "qk_clip_layers")
    )


def _as_span(s: QKClipSpan | Mapping[str, Any], where: str) -> QKClipSpan:
    if isinstance(s, QKClipSpan):
        span = s
    else:
        missing = {"param", "stride", "start", "length", "power"} - set(s)
        if missing:
            raise ValueError(f"qk_clip_layers(): {where} is missing {sorted(missing)}")
        span = QKClipSpan(s["param"], int(s["stride"]), int(s["start"]), int(s["length"]), float(s["power"]))
    if not isinstance(span.param, Tensor):
        raise ValueError(f"qk_clip_layers(): {where}.param must be a Tensor, got {type(span.param).__name__}")
    if span.start < 0 or span.length <= 0 or span.start + span.length > span.stride:
        raise ValueError(
            f"qk_clip_layers(): {where} rows [start={span.start}, +length={span.length}) must lie "
            f"inside one head's stride={span.stride}"
        )
    return span


def normalize_layers(layers: Sequence[QKClipLayer | Mapping[str, Any]]) -> list[QKClipLayer]:
    """Accept the protocol's dicts (or our dataclasses) and check them against the params."""
    out = []
    for i, layer in enumerate(layers):
        if isinstance(layer, QKClipLayer):
            name, heads, spans = layer.name, layer.num_heads, layer.spans
        else:
            name, heads, spans = layer.get("name", f"layer{i}"), layer["num_heads"], layer["spans"]
        norm_spans = [_as_span(s, f"layer {name!r} span {j}") for j, s in enumerate(spans)]
        for j, s in enumerate(norm_spans):
            if s.param.shape[0] < heads * s.stride:
                raise ValueError(
                    f"qk_clip_layers(): layer {name!r} span {j}: param has {s.param.shape[0]} rows on dim 0, "
                    f"fewer than num_heads*stride = {heads}*{s.stride}"
                )
        out.append(QKClipLayer(str(name), int(heads), norm_spans))
    return out


def reduce_max_logits(max_logits_LH: Tensor, group: Any = None) -> Tensor:
    """MAX all-reduce across data-parallel ranks so every rank clips with the same gamma."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        max_logits_LH = max_logits_LH.clone()
        dist.all_reduce(max_logits_LH, op=dist.ReduceOp.MAX, group=group)
    return max_logits_LH


def clip_factors(max_logits_LH: Tensor, tau: float) -> Tensor:
    """gamma [L, H]: tau / S where S > tau, exactly 1.0 elsewhere (so those rows stay bit-identical)."""
    S = max_logits_LH.float()
    return torch.where(S > tau, tau / S, torch.ones_like(S))


def _local_rows(param: Tensor) -> tuple[Tensor, int]:
    """The locally stored rows of `param` and the global index of the first one (FSDP2 Shard(0))."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return param, 0
    if not isinstance(param, DTensor):
        return param, 0
    placements = param.placements
    if any(not isinstance(pl, (Shard, Replicate)) for pl in placements) or any(
        isinstance(pl, Shard) and pl.dim != 0 for pl in placements
    ):
        raise ValueError(
            f"QK-Clip: DTensor placements {placements} are not supported (need Shard(0) or Replicate)"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    return param.to_local(), int(offset[0]) if offset else 0


@torch.no_grad()
def apply_qk_clip(layers: Sequence[QKClipLayer], max_logits_LH: Tensor, tau: float) -> Tensor:
    """Scale the listed rows of every clipped head in place; return the clipped mask [L, H]."""
    if max_logits_LH.ndim != 2 or max_logits_LH.shape[0] != len(layers):
        raise ValueError(
            f"attention_max_logits() has shape {tuple(max_logits_LH.shape)}, expected [{len(layers)}, num_heads] "
            "(one row per qk_clip_layers() entry)"
        )
    gamma_LH = clip_factors(max_logits_LH, tau)
    clipped_LH = max_logits_LH.float() > tau
    for l, layer in enumerate(layers):
        if not bool(clipped_LH[l, : layer.num_heads].any()):
            continue
        gamma_H = gamma_LH[l, : layer.num_heads]
        for span in layer.spans:
            local, row0 = _local_rows(span.param)
            # per-row factor over the whole parameter; 1.0 (exact) outside the span and for unclipped heads
            scale_R = torch.ones(span.param.shape[0], dtype=torch.float32, device=gamma_H.device)
            rows = scale_R[: layer.num_heads * span.stride].view(layer.num_heads, span.stride)
            rows[:, span.start : span.start + span.length] = (gamma_H**span.power)[:, None]
            scale_R = scale_R[row0 : row0 + local.shape[0]].to(device=local.device)
            touched = scale_R != 1.0
            if bool(touched.any()):
                idx = touched.nonzero().squeeze(1)
                shape = (-1,) + (1,) * (local.ndim - 1)
                local[idx] = (local[idx].float() * scale_R[idx].view(shape)).to(local.dtype)
    return clipped_LH
