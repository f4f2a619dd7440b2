"""QK-Clip for ordinary MHA/GQA models (HF Llama-style attention, or your own), via forward hooks.

`attach_qk_clip(model)` finds every attention module with `q_proj` / `k_proj` linears
(transformers' Llama, Mistral, Qwen2, ... and plain modules built the same way), records each
head's max logit during training-mode forwards, and describes the rows to clip:
    MHA  query and key rows (and biases) x sqrt(gamma)
    GQA  query rows (and bias) x gamma; the shared key head is left alone, since scaling it
         would also change the other query heads that read it.
The max logit is recomputed from the projections' outputs captured by hooks (one extra
Q K^T per layer, no extra projection), with the module's own RoPE when it has one.
Models with QK-norm (`q_norm` / `k_norm`) are refused: a norm after the projection cancels
any scaling of the projection's rows, so QK-Clip cannot govern their logits.

Tensor legend: B batch, S query positions, T key positions, H query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MHAQKClipAdapter", "attach_qk_clip"]

RopeFn = Callable[[Tensor, Tensor, tuple, dict], tuple[Tensor, Tensor]]

# Most logits materialised at once while recomputing a layer's max (16M fp32 = 64 MiB).
LOGIT_BLOCK_ELEMS = 1 << 24


@dataclass
class _AttnInfo:
    name: str
    module: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    causal: bool
    rope: RopeFn | None


def _hf_rope(module: nn.Module) -> RopeFn | None:
    """The model family's own `apply_rotary_pos_emb`, fed the `position_embeddings` kwarg."""
    fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    if fn is None:
        return None

    def rope(q_BHSD: Tensor, k_BKTD: Tensor, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor]:
        pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        if pe is None:
            return q_BHSD, k_BKTD
        cos, sin = pe
        return fn(q_BHSD, k_BKTD, cos, sin)

    return rope


class MHAQKClipAdapter:
    """Implements the QK-Clip protocol for the attention modules of an MHA/GQA model."""

    def __init__(
        self,
        model: nn.Module,
        attention_modules: Sequence[nn.Module] | None = None,
        rope: RopeFn | None | str = "auto",
        causal: bool | None = None,
    ) -> None:
        named = {id(m): n for n, m in model.named_modules()}
        mods = list(attention_modules) if attention_modules is not None else [
            m for m in model.modules() if isinstance(getattr(m, "q_proj", None), nn.Linear)
            and isinstance(getattr(m, "k_proj", None), nn.Linear)
        ]
        if not mods:
            raise ValueError(
                f"attach_qk_clip: no attention module with q_proj/k_proj nn.Linear found in {type(model).__name__}; "
                "pass attention_modules=[...] or implement the QK-Clip protocol on the model"
            )
        self.layers: list[_AttnInfo] = []
        for m in mods:
            name = named.get(id(m), type(m).__name__)
            for norm in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
                if getattr(m, norm, None) is not None and not isinstance(getattr(m, norm), nn.Identity):
                    raise ValueError(
                        f"attach_qk_clip: {name} has QK-norm ({norm}); its logits are normalised after the "
                        "projection, so scaling q_proj/k_proj rows cannot bound them. QK-Clip does not apply "
                        "to QK-norm models (they need no clip: the norm already bounds q and k)."
                    )
            head_dim = getattr(m, "head_dim", None)
            if head_dim is None:
                raise ValueError(f"attach_qk_clip: {name} has no `head_dim` attribute")
            H, K = m.q_proj.out_features // head_dim, m.k_proj.out_features // head_dim
            if H * head_dim != m.q_proj.out_features or K * head_dim != m.k_proj.out_features or H % K:
                raise ValueError(
                    f"attach_qk_clip: {name}: q_proj out {m.q_proj.out_features} / k_proj out "
                    f"{m.k_proj.out_features} do not split into heads of head_dim={head_dim}"
                )
            scaling = float(getattr(m, "scaling", head_dim**-0.5))
            is_causal = bool(getattr(m, "is_causal", True)) if causal is None else causal
            rope_fn = _hf_rope(m) if rope == "auto" else rope  # type: ignore[assignment]
            self.layers.append(_AttnInfo(name, m, m.q_proj, m.k_proj, H, K, head_dim, scaling, is_causal, rope_fn))
        self.max_heads = max(a.num_heads for a in self.layers)
        device = self.layers[0].q_proj.weight.device
        self._max_LH = torch.full((len(self.layers), self.max_heads), float("-inf"), device=device)
        self._stash: dict[int, dict[str, Tensor]] = {}
        self._handles: list[Any] = []
        for l, info in enumerate(self.layers):
            self._handles.append(info.q_proj.register_forward_hook(self._capture(l, "q")))
            self._handles.append(info.k_proj.register_forward_hook(self._capture(l, "k")))
            self._handles.append(info.module.register_forward_hook(self._record(l), with_kwargs=True))

    # -- hooks -----------------------------------------------------------------------------
    def _capture(self, l: int, which: str) -> Callable:
        def hook(mod: nn.Module, args: tuple, out: Tensor) -> None:
            if self.layers[l].module.training:
                self._stash.setdefault(l, {})[which] = out.detach()

        return hook

    def _record(self, l: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            stash = self._stash.pop(l, None)
            if not mod.training or not stash or "q" not in stash or "k" not in stash:
                return
            with torch.no_grad():
                self._max_LH[l, : self.layers[l].num_heads] = torch.maximum(
                    self._max_LH[l, : self.layers[l].num_heads],
                    self._layer_max(self.layers[l], stash["q"], stash["k"], args, kwargs).to(self._max_LH.device),
                )

        return hook

    @staticmethod
    def _layer_max(info: _AttnInfo, q: Tensor, k: Tensor, args: tuple, kwargs: dict) -> Tensor:
        B, S = q.shape[0], q.shape[1]
        T = k.shape[1]
        q_BHSD = q.view(B, S, info.num_heads, info.head_dim).transpose(1, 2).float()
        k_BKTD = k.view(B, T, info.num_kv_heads, info.head_dim).transpose(1, 2).float()
        if info.rope is not None:
            q_BHSD, k_BKTD = info.rope(q_BHSD, k_BKTD, args, kwargs)
        k_BHTD = k_BKTD.repeat_interleave(info.num_heads // info.num_kv_heads, dim=1)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if isinstance(mask, Tensor):
            mask = mask[..., -T:]
        else:
            mask = None
        # query blocks bound the memory to B*H*block*T logits (long sequences would need B*H*S*T)
        block = max(1, min(S, LOGIT_BLOCK_ELEMS // max(1, B * info.num_heads * T)))
        max_H = torch.full((info.num_heads,), float("-inf"), device=q.device)
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            logits_BHsT = (q_BHSD[:, :, s0:s1] @ k_BHTD.transpose(-1, -2)) * info.scaling
            if mask is not None:
                m = mask[..., s0:s1, :] if mask.shape[-2] == S else mask
                allowed = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
            elif info.causal:
                pos_q = torch.arange(s0, s1, device=q.device)[:, None] + (T - S)
                allowed = torch.arange(T, device=q.device)[None, :] <= pos_q
            else:
                allowed = None
            if allowed is not None:
                logits_BHsT = logits_BHsT.masked_fill(~allowed, float("-inf"))
            max_H = torch.maximum(max_H, logits_BHsT.amax(dim=(0, 2, 3)))
        return max_H

    # -- the QK-Clip protocol --------------------------------------------------------------
    def attention_max_logits(self) -> Tensor:
        return self._max_LH.clamp(min=torch.finfo(torch.float32).min).clone()

    def reset_attention_max_logits(self) -> None:
        self._max_LH.fill_(float("-inf"))

    def qk_clip_layers(self) -> list[dict[str, Any]]:
        out = []
        for info in self.layers:
            gqa = info.num_kv_heads != info.num_heads
            spans = []
            projs = [(info.q_proj, 1.0 if gqa else 0.5)] + ([] if gqa else [(info.k_proj, 0.5)])
            for proj, power in projs:
                for p in (proj.weight, proj.bias):
                    if p is not None:
                        spans.append(
                            {"param": p, "stride": info.head_dim, "start": 0, "length": info.head_dim, "power": power}
                        )
            out.append({"name": info.name, "num_heads": info.num_heads, "spans": spans})
        return out

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def attach_qk_clip(
    model: nn.Module,
    attention_modules: Sequence[nn.Module] | None = None,
    rope: RopeFn | None | str = "auto",
    causal: bool | None = None,
) -> MHAQKClipAdapter:
    """Hook `model`'s MHA/GQA attention for QK-Clip; pass the result as `MuonClip(..., qk_clip=...)`.

    `rope`: "auto" uses the module's family `apply_rotary_pos_emb` with the `position_embeddings`
    kwarg (transformers); a callable `(q_BHSD, k_BKTD, args, kwargs) -> (q, k)` for your own
    model; None for no rotary embedding. Without an attention mask argument the mask is
    causal when the module says `is_causal` (default) or `causal=True`.
    """
    return MHAQKClipAdapter(model, attention_modules, rope=rope, causal=causal)
