"""QK-Clip for ordinary MHA/GQA models (HF Llama-style attention, `nn.MultiheadAttention`, or your own).

`attach_qk_clip(model)` finds every attention module with `q_proj` / `k_proj` linears
(transformers' Llama, Mistral, Qwen2, ... and plain modules built the same way) and every
`torch.nn.MultiheadAttention` (also inside `nn.TransformerEncoderLayer` / `DecoderLayer`),
records each head's max logit during training-mode forwards, and describes the rows to clip:
    MHA  query and key rows (and biases) x sqrt(gamma)
    GQA  query rows (and bias) x gamma; the shared key head is left alone, since scaling it
         would also change the other query heads that read it.
The max logit is recomputed from the projections' outputs captured by hooks (one extra
Q K^T per layer, no extra projection), with the module's own RoPE when it has one. For
`nn.MultiheadAttention` (whose projections are not submodules) a forward hook recomputes
q = query W_q^T + b_q and k = key W_k^T + b_k without grad, from the packed `in_proj_weight`
[3E, E] or the separate `q_proj_weight` / `k_proj_weight`, and applies `attn_mask` (bool: True =
not allowed; float: additive, an entry <= -1e4 or -inf disallows the pair), `key_padding_mask`
and `is_causal` as the module does; the clip spans are views of the packed weight's q and k rows.
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
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MHAQKClipAdapter", "attach_qk_clip"]

RopeFn = Callable[[Tensor, Tensor, tuple, dict], tuple[Tensor, Tensor]]

# Most logits materialised at once while recomputing a layer's max (16M fp32 = 64 MiB).
LOGIT_BLOCK_ELEMS = 1 << 24

# A float (additive) attention-mask entry at or below this disallows its query-key pair.
FLOAT_MASK_DISALLOWED = -1e4

# nn.MultiheadAttention.forward's parameters, in order (to read positional and keyword arguments alike).
_MHA_FORWARD_ARGS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)

WHAT_TO_EXPOSE = (
    "A custom attention module takes part by exposing `q_proj` and `k_proj` (nn.Linear submodules, output "
    "rows grouped by head) and `head_dim` (int), optionally `num_heads` and `num_key_value_heads` (checked "
    "against the projections; `num_heads` stands in for a missing head_dim), `scaling` (default "
    "head_dim**-0.5) and `is_causal` (default True); or by being a torch.nn.MultiheadAttention (found "
    "automatically, also inside nn.Transformer*Layer); or the model implements the QK-Clip protocol itself: "
    "attention_max_logits() -> Tensor [L, H], reset_attention_max_logits() and qk_clip_layers() (see "
    "k2_optim.qk_clip) and is passed to MuonClip directly. Pick modules explicitly with "
    "attach_qk_clip(model, attention_modules=[...])."
)


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


@dataclass
class _TorchMHAInfo:
    """A torch.nn.MultiheadAttention: projections are parameters of the module itself."""

    name: str
    module: nn.MultiheadAttention
    num_heads: int
    head_dim: int

    @property
    def scaling(self) -> float:
        return self.head_dim**-0.5


def _is_linear_attention(m: nn.Module) -> bool:
    return isinstance(getattr(m, "q_proj", None), nn.Linear) and isinstance(
        getattr(m, "k_proj", None), nn.Linear
    )


def _allowed(mask: Tensor) -> Tensor:
    """True where a query-key pair may attend (bool masks: True = not allowed; float: additive)."""
    if mask.dtype == torch.bool:
        return ~mask
    if mask.is_floating_point():
        return mask > FLOAT_MASK_DISALLOWED
    return mask == 0  # the deprecated uint8 masks: nonzero = not allowed


def _masked_max_H(q_BHSD: Tensor, k_BHTD: Tensor, scaling: float, allowed: Tensor | None) -> Tensor:
    """Per-head max of q.k * scaling over allowed pairs; `allowed` broadcasts to [B, H, S, T]."""
    B, H, S, _ = q_BHSD.shape
    T = k_BHTD.shape[2]
    block = max(1, min(S, LOGIT_BLOCK_ELEMS // max(1, B * H * T)))
    max_H = torch.full((H,), float("-inf"), device=q_BHSD.device)
    for s0 in range(0, S, block):
        s1 = min(S, s0 + block)
        logits_BHsT = (q_BHSD[:, :, s0:s1] @ k_BHTD.transpose(-1, -2)) * scaling
        if allowed is not None:
            a = allowed[..., s0:s1, :] if allowed.shape[-2] == S else allowed
            logits_BHsT = logits_BHsT.masked_fill(~a, float("-inf"))
        max_H = torch.maximum(max_H, logits_BHsT.amax(dim=(0, 2, 3)))
    return max_H


def _torch_mha_layer_max(info: _TorchMHAInfo, inputs: dict[str, Any]) -> Tensor:
    """Recompute an nn.MultiheadAttention call's per-head max logit from its inputs (no grad)."""
    m = info.module
    E, H, D = m.embed_dim, info.num_heads, info.head_dim
    query, key = inputs["query"], inputs["key"]
    if query.dim() == 2:  # unbatched [S, E] (also under batch_first)
        query_BSE, key_BTE = query.unsqueeze(0), key.unsqueeze(0)
    elif m.batch_first:
        query_BSE, key_BTE = query, key
    else:  # [S, B, E]
        query_BSE, key_BTE = query.transpose(0, 1), key.transpose(0, 1)
    B, S, T = query_BSE.shape[0], query_BSE.shape[1], key_BTE.shape[1]
    if m._qkv_same_embed_dim:
        w_q, w_k = m.in_proj_weight[:E], m.in_proj_weight[E : 2 * E]
    else:
        w_q, w_k = m.q_proj_weight, m.k_proj_weight
    b = m.in_proj_bias
    b_q, b_k = (b[:E], b[E : 2 * E]) if b is not None else (None, None)
    q_BSE = F.linear(query_BSE.to(w_q.dtype), w_q, b_q)
    k_BTE = F.linear(key_BTE.to(w_k.dtype), w_k, b_k)
    extra = 0  # keys appended after the projected ones; always allowed (the module pads masks with 0)
    if m.bias_k is not None:
        k_BTE = torch.cat([k_BTE, m.bias_k.reshape(1, 1, E).expand(B, 1, E).to(k_BTE.dtype)], dim=1)
        extra += 1
    if m.add_zero_attn:
        k_BTE = torch.cat([k_BTE, k_BTE.new_zeros(B, 1, E)], dim=1)
        extra += 1
    q_BHSD = q_BSE.reshape(B, S, H, D).transpose(1, 2).float()
    k_BHTD = k_BTE.reshape(B, T + extra, H, D).transpose(1, 2).float()

    allowed: Tensor | None = None
    attn_mask, kpm = inputs.get("attn_mask"), inputs.get("key_padding_mask")
    if isinstance(attn_mask, Tensor):
        a = _allowed(attn_mask)
        a = a.view(1, 1, S, T) if a.dim() == 2 else a.reshape(B, H, S, T)  # [S, T] or [B*H, S, T]
        allowed = a
    elif inputs.get("is_causal", False):
        allowed = torch.ones(S, T, dtype=torch.bool, device=q_BHSD.device).tril(T - S).view(1, 1, S, T)
    if isinstance(kpm, Tensor):
        p_B11T = _allowed(kpm).reshape(B, 1, 1, T)
        allowed = p_B11T if allowed is None else allowed & p_B11T
    if allowed is not None and extra:
        allowed = F.pad(allowed, (0, extra), value=True)
    return _masked_max_H(q_BHSD, k_BHTD, info.scaling, allowed)


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
        if attention_modules is not None:
            mods = list(attention_modules)
        else:
            mods = [
                m for m in model.modules() if isinstance(m, nn.MultiheadAttention) or _is_linear_attention(m)
            ]
        if not mods:
            raise ValueError(
                f"attach_qk_clip: no attention module found in {type(model).__name__}. {WHAT_TO_EXPOSE}"
            )
        self.layers: list[_AttnInfo | _TorchMHAInfo] = []
        for m in mods:
            name = named.get(id(m), type(m).__name__)
            if isinstance(m, nn.MultiheadAttention):
                self.layers.append(_TorchMHAInfo(name, m, m.num_heads, m.head_dim))
                continue
            if not _is_linear_attention(m):
                raise ValueError(
                    f"attach_qk_clip: {name} ({type(m).__name__}) is neither nn.MultiheadAttention nor a module "
                    f"with q_proj/k_proj nn.Linear submodules. {WHAT_TO_EXPOSE}"
                )
            for norm in ("q_norm", "k_norm", "q_layernorm", "k_layernorm"):
                if getattr(m, norm, None) is not None and not isinstance(getattr(m, norm), nn.Identity):
                    raise ValueError(
                        f"attach_qk_clip: {name} has QK-norm ({norm}); its logits are normalised after the "
                        "projection, so scaling q_proj/k_proj rows cannot bound them. QK-Clip does not apply "
                        "to QK-norm models (they need no clip: the norm already bounds q and k)."
                    )
            head_dim = getattr(m, "head_dim", None)
            if head_dim is None:
                num_heads = getattr(m, "num_heads", None)
                if isinstance(num_heads, int) and num_heads > 0 and m.q_proj.out_features % num_heads == 0:
                    head_dim = m.q_proj.out_features // num_heads
                else:
                    raise ValueError(
                        f"attach_qk_clip: {name} has q_proj/k_proj but no `head_dim` (or `num_heads`) attribute "
                        f"to split them into heads. {WHAT_TO_EXPOSE}"
                    )
            H, K = m.q_proj.out_features // head_dim, m.k_proj.out_features // head_dim
            if H * head_dim != m.q_proj.out_features or K * head_dim != m.k_proj.out_features or H % K:
                raise ValueError(
                    f"attach_qk_clip: {name}: q_proj out {m.q_proj.out_features} / k_proj out "
                    f"{m.k_proj.out_features} do not split into heads of head_dim={head_dim}"
                )
            for attr, n in (("num_heads", H), ("num_key_value_heads", K)):
                declared = getattr(m, attr, None)
                if isinstance(declared, int) and declared != n:
                    raise ValueError(
                        f"attach_qk_clip: {name}.{attr} = {declared}, but its q_proj/k_proj outputs "
                        f"({m.q_proj.out_features}/{m.k_proj.out_features}) with head_dim={head_dim} give {n}"
                    )
            scaling = float(getattr(m, "scaling", head_dim**-0.5))
            is_causal = bool(getattr(m, "is_causal", True)) if causal is None else causal
            rope_fn = _hf_rope(m) if rope == "auto" else rope  # type: ignore[assignment]
            self.layers.append(
                _AttnInfo(name, m, m.q_proj, m.k_proj, H, K, head_dim, scaling, is_causal, rope_fn)
            )
        self.max_heads = max(a.num_heads for a in self.layers)
        device = next(self.layers[0].module.parameters()).device
        self._max_LH = torch.full((len(self.layers), self.max_heads), float("-inf"), device=device)
        self._stash: dict[int, dict[str, Tensor]] = {}
        self._handles: list[Any] = []
        for l, info in enumerate(self.layers):
            if isinstance(info, _TorchMHAInfo):
                self._handles.append(
                    info.module.register_forward_hook(self._record_torch_mha(l), with_kwargs=True)
                )
                continue
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
                    self._layer_max(self.layers[l], stash["q"], stash["k"], args, kwargs).to(
                        self._max_LH.device
                    ),
                )

        return hook

    def _record_torch_mha(self, l: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if not mod.training:
                return
            inputs = dict(zip(_MHA_FORWARD_ARGS, args))
            inputs.update(kwargs)
            info = self.layers[l]
            with torch.no_grad():
                self._max_LH[l, : info.num_heads] = torch.maximum(
                    self._max_LH[l, : info.num_heads],
                    _torch_mha_layer_max(info, inputs).to(self._max_LH.device),  # type: ignore[arg-type]
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
        if mask is not None:
            allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        elif info.causal:
            allowed = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(T - S)
        else:
            allowed = None
        # query blocks bound the memory to B*H*block*T logits (long sequences would need B*H*S*T)
        return _masked_max_H(q_BHSD, k_BHTD, info.scaling, allowed)

    # -- the QK-Clip protocol --------------------------------------------------------------
    def attention_max_logits(self) -> Tensor:
        return self._max_LH.clamp(min=torch.finfo(torch.float32).min).clone()

    def reset_attention_max_logits(self) -> None:
        self._max_LH.fill_(float("-inf"))

    def qk_clip_layers(self) -> list[dict[str, Any]]:
        out = []
        for info in self.layers:
            if isinstance(info, _TorchMHAInfo):
                out.append(
                    {"name": info.name, "num_heads": info.num_heads, "spans": self._torch_mha_spans(info)}
                )
                continue
            gqa = info.num_kv_heads != info.num_heads
            spans = []
            projs = [(info.q_proj, 1.0 if gqa else 0.5)] + ([] if gqa else [(info.k_proj, 0.5)])
            for proj, power in projs:
                for p in (proj.weight, proj.bias):
                    if p is not None:
                        spans.append(
                            {
                                "param": p,
                                "stride": info.head_dim,
                                "start": 0,
                                "length": info.head_dim,
                                "power": power,
                            }
                        )
            out.append({"name": info.name, "num_heads": info.num_heads, "spans": spans})
        return out

    @staticmethod
    def _torch_mha_spans(info: _TorchMHAInfo) -> list[dict[str, Any]]:
        """q rows and k rows (weights, biases, bias_k), power 0.5 each: views of the parameters' data,
        so apply_qk_clip's in-place row scaling lands in the module's own (packed) parameters."""
        m, E, D = info.module, info.module.embed_dim, info.head_dim
        if m._qkv_same_embed_dim:
            rows = [m.in_proj_weight.data[0:E], m.in_proj_weight.data[E : 2 * E]]
        else:
            rows = [m.q_proj_weight.data, m.k_proj_weight.data]
        if m.in_proj_bias is not None:
            rows += [m.in_proj_bias.data[0:E], m.in_proj_bias.data[E : 2 * E]]
        if m.bias_k is not None:  # [1, 1, E]: the extra key appended to every sequence
            rows.append(m.bias_k.data.view(E))
        return [{"param": r, "stride": D, "start": 0, "length": D, "power": 0.5} for r in rows]

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
