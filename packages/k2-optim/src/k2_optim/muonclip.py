"""MuonClip = Muon for hidden matrices + AdamW for the rest + QK-Clip after each step.

Which optimizer gets which parameter (`muonclip_param_groups`):
    Muon   every hidden matrix: attention projections, dense and expert MLP weights (stacked
           [E, out, in] experts are orthogonalised per expert; fused gate_up per half; a packed
           nn.MultiheadAttention in_proj_weight per q, k and v), and, by default, the MoE router
           gate [n_experts, hidden].
    AdamW  token embeddings, the LM head (the output embedding), and all 1-D parameters (norm
           weights, biases). Embedding rows are per-token lookups and the head's rows are per-token
           classifiers: neither acts as a linear map on a hidden space, which is what Muon's
           orthogonalisation assumes (Moonlight and K2 keep them on AdamW).
    Router The router gate is a genuine linear map hidden -> expert scores, and Moonlight's
           reference recipe and K2's Algorithm 1 (Muon for every weight matrix except the
           embedding and head) put it on Muon, so that is the default. `router="adamw"` moves it
           to AdamW for those who want a sign-like per-expert update instead. The router's
           selection bias (aux-loss-free balancing) is a buffer updated by the balancing rule,
           not by any optimizer.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .adamw import adamw_group_step
from .muon import Muon
from .newton_schulz import Coeffs
from .qk_clip import apply_qk_clip, normalize_layers, reduce_max_logits, supports_qk_clip

__all__ = ["MuonClip", "muonclip_param_groups"]

_ROUTER_RE = re.compile(r"(^|\.)(gate|router)(\.weight)?$")
_FUSED_GATE_UP_RE = re.compile(r"gate_up_proj(\.weight)?$")


def _lm_head_params(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
        except NotImplementedError:
            head = None
        if isinstance(head, nn.Module):
            ids.update(id(p) for p in head.parameters())
    for name, p in model.named_parameters():
        if re.search(r"(^|\.)lm_head\.", name):
            ids.add(id(p))
    return ids


def muonclip_param_groups(
    model: nn.Module,
    router: str = "muon",
    fused: Mapping[str, Sequence[int] | tuple[Sequence[int], int]] | None = None,
) -> list[dict[str, Any]]:
    """Split `model`'s trainable parameters into Muon and AdamW param groups (see module doc).

    `fused` maps a regex on parameter names to the sizes of the logical matrices stacked in
    that parameter along its rows (or `(sizes, dim)`); names ending in `gate_up_proj` (the
    transformers MoE layout [E, 2F, D]) are split into two equal halves automatically, and the
    packed `in_proj_weight` [3E, E] of an `nn.MultiheadAttention` into its q, k and v matrices.
    """
    if router not in ("muon", "adamw"):
        raise ValueError(f"muonclip_param_groups: router must be 'muon' or 'adamw', got {router!r}")
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # nn.MultiheadAttention's packed in_proj_weight [3E, E] holds three matrices (W_q, W_k, W_v)
    packed_qkv = {
        id(m.in_proj_weight): m.embed_dim
        for m in model.modules()
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None
    }
    head_ids = _lm_head_params(model)
    adamw: list[Tensor] = []
    muon_by_split: dict[tuple | None, list[Tensor]] = {}
    names: dict[str, list[str]] = {"adamw": []}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_router = bool(_ROUTER_RE.search(name)) and p.ndim == 2
        if p.ndim < 2 or id(p) in embed_ids or id(p) in head_ids or (is_router and router == "adamw"):
            adamw.append(p)
            names["adamw"].append(name)
            continue
        split = None
        for pattern, spec in (fused or {}).items():
            if re.search(pattern, name):
                if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], (tuple, list)):
                    sizes, dim = spec
                else:
                    sizes, dim = spec, -2
                split = (tuple(int(s) for s in sizes), int(dim))
                break
        if split is None and id(p) in packed_qkv:
            e = packed_qkv[id(p)]
            split = ((e, e, e), -2)
        if split is None and _FUSED_GATE_UP_RE.search(name) and p.shape[-2] % 2 == 0:
            half = p.shape[-2] // 2
            split = ((half, half), -2)
        muon_by_split.setdefault(split, []).append(p)
        names.setdefault(f"muon{split or ''}", []).append(name)
    groups: list[dict[str, Any]] = []
    for split, params in muon_by_split.items():
        g: dict[str, Any] = {"params": params, "algorithm": "muon"}
        if split is not None:
            g["split_sizes"], g["split_dim"] = split
        groups.append(g)
    if adamw:
        groups.append({"params": adamw, "algorithm": "adamw"})
    return groups


class MuonClip(Muon):
    """Muon + AdamW + QK-Clip in one torch optimizer (one state_dict, one LR scheduler).

    `MuonClip(model, lr, weight_decay, tau=100.0)` builds the groups with
    `muonclip_param_groups` and clips with the model's QK-Clip protocol (or the adapter passed
    as `qk_clip=`). The param-group form `MuonClip(groups, ..., qk_clip=model_or_adapter)`
    takes groups that each say `"algorithm": "muon"` or `"adamw"`.

    AdamW groups use `lr`, `weight_decay` (or `adamw_weight_decay`), `betas`, `adamw_eps`.
    After the updates, the recorded max logits are MAX-all-reduced over `process_group`
    (when torch.distributed is initialised), heads above `tau` are clipped, and the model's
    max-logit record is reset, so with gradient accumulation it covers the whole step.
    """

    def __init__(
        self,
        model_or_params: nn.Module | Iterable[dict[str, Any]],
        lr: float = 2e-4,
        weight_decay: float = 0.1,
        tau: float | None = 100.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str | Coeffs | Sequence[Coeffs] = "keller",
        ns_dtype: torch.dtype | str | None = None,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        router: str = "muon",
        fused: Mapping[str, Any] | None = None,
        qk_clip: Any = None,
        process_group: Any = None,
    ) -> None:
        if isinstance(model_or_params, nn.Module):
            groups = muonclip_param_groups(model_or_params, router=router, fused=fused)
            if qk_clip is None and supports_qk_clip(model_or_params):
                qk_clip = model_or_params
            elif qk_clip is None and tau is not None:
                warnings.warn(
                    f"MuonClip: {type(model_or_params).__name__} does not implement the QK-Clip protocol and no "
                    "qk_clip= source was given, so QK-Clip is off (Muon + AdamW only). For an MHA/GQA model "
                    "(q_proj/k_proj nn.Linear attention, or nn.MultiheadAttention) pass "
                    "qk_clip=k2_optim.attach_qk_clip(model); pass tau=None to silence this.",
                    stacklevel=2,
                )
        else:
            groups = [dict(g) for g in model_or_params]
            for i, g in enumerate(groups):
                if not isinstance(g, dict) or g.get("algorithm") not in ("muon", "adamw"):
                    raise ValueError(
                        f"MuonClip: param group {i} must be a dict with 'algorithm': 'muon' or 'adamw' "
                        "(or pass the model itself to have the groups built for you)"
                    )
        for g in groups:
            if g["algorithm"] == "adamw" and adamw_weight_decay is not None:
                g.setdefault("weight_decay", adamw_weight_decay)
        if tau is not None and tau <= 0:
            raise ValueError(f"MuonClip: tau must be > 0 (or None to disable QK-Clip), got {tau}")
        if qk_clip is not None and not supports_qk_clip(qk_clip):
            raise TypeError(
                f"MuonClip: qk_clip={type(qk_clip).__name__} does not implement the QK-Clip protocol "
                "(attention_max_logits, reset_attention_max_logits, qk_clip_layers); wrap an MHA/GQA "
                "model with k2_optim.attach_qk_clip(model)"
            )
        self.tau = tau
        self.qk_clip_source = qk_clip
        self.process_group = process_group
        self._clip_stats: dict[str, Any] = {}
        self._ever_clipped: Tensor | None = None
        self._clip_steps = 0
        super().__init__(
            groups,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        for g in self.param_groups:
            g.setdefault("betas", betas)
            g.setdefault("adamw_eps", adamw_eps)

    def _is_muon_group(self, group: dict[str, Any]) -> bool:
        return group.get("algorithm", "muon") == "muon"

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if self._is_muon_group(group):
                self._muon_group_step(group)
            else:
                adamw_group_step(group, self.state)
        if self.qk_clip_source is not None and self.tau is not None:
            self._qk_clip()
        return loss

    @torch.no_grad()
    def _qk_clip(self) -> None:
        source = self.qk_clip_source
        layers = normalize_layers(source.qk_clip_layers())
        S_LH = source.attention_max_logits().detach().float()
        S_LH = reduce_max_logits(S_LH, self.process_group)
        clipped_LH = apply_qk_clip(layers, S_LH, self.tau)
        source.reset_attention_max_logits()
        valid_LH = torch.zeros_like(clipped_LH)
        for l, layer in enumerate(layers):
            valid_LH[l, : layer.num_heads] = True
        clipped_LH = clipped_LH & valid_LH
        if self._ever_clipped is None or self._ever_clipped.shape != clipped_LH.shape:
            self._ever_clipped = torch.zeros_like(clipped_LH)
        self._ever_clipped |= clipped_LH.cpu()
        self._clip_steps += 1
        heads = [(layers[l].name, int(h)) for l, h in clipped_LH.nonzero().tolist()]
        masked = torch.where(valid_LH, S_LH, torch.full_like(S_LH, float("-inf")))
        total = int(valid_LH.sum())
        self._clip_stats = {
            "step": self._clip_steps,
            "tau": self.tau,
            "num_clipped": len(heads),
            "clipped_heads": heads,
            "max_logit_per_layer": {layers[l].name: float(masked[l].max()) for l in range(len(layers))},
            "max_logit": float(masked.max()) if total else float("nan"),
            "num_heads": total,
            "fraction_ever_clipped": float(self._ever_clipped.sum()) / total if total else 0.0,
        }

    def last_clip_stats(self) -> dict[str, Any]:
        """After a step: heads clipped this step (`clipped_heads`: (layer name, head)), the max
        logit per layer (after the data-parallel MAX), and the fraction of heads ever clipped
        (K2 reports 12.7% over its first 70k steps)."""
        return dict(self._clip_stats)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        sd = super().state_dict()
        sd["qk_clip"] = {
            "tau": self.tau,
            "steps": self._clip_steps,
            "ever_clipped": None if self._ever_clipped is None else self._ever_clipped.clone(),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        qk = state_dict.pop("qk_clip", None)
        super().load_state_dict(state_dict)
        if qk is not None:
            self.tau = qk["tau"]
            self._clip_steps = int(qk["steps"])
            ev = qk["ever_clipped"]
            self._ever_clipped = None if ev is None else ev.clone().bool()
