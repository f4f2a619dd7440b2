"""K2ForCausalLM: Kimi K2 / DeepSeek-V3 decoder (MLA attention + fine-grained MoE), readable top to bottom.

Shape legend: B batch, S sequence (queries), L keys (= S here), D hidden size, H attention heads,
Q q_lora_rank, C kv_lora_rank, P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, Dh = P + R,
T tokens (B * S), N vocabulary size.

Parameter names equal transformers' DeepseekV3ForCausalLM, except routed experts, which are stacked
(`mlp.experts.gate_proj [E, I, D]`); k2_model.checkpoint maps them to HF's per-expert names.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from k2_kernels import ops as _kops
from torch import Tensor, nn

from k2_model.checkpoint import load_pretrained, save_pretrained
from k2_model.config import K2Config
from k2_model.moe import MLP, MoE, RoutedExperts, Router
from k2_model.rope import apply_rope_interleaved, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (the order transformers uses)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if _kops.preferred("rms_norm", x.device):
                # k2-kernels' fused forward and backward: torch's CPU backward is composite and
                # took 15-30x its forward (~20 ms of a tiny-model training step)
                return _kops.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # fused; same math in fp32
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention: low-rank q and kv paths, nope/rope split, one shared rotary key.

    In training mode it records each head's maximum pre-softmax logit (after the softmax scale,
    over the pairs the mask allows) into `max_logits_H`, the QK-Clip signal.
    """

    def __init__(self, config: K2Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.P, self.R, self.V = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.C = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * (self.P + self.R), bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.P + self.R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.C + self.R, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.C)
        self.kv_b_proj = nn.Linear(self.C, H * (self.P + self.V), bias=False)
        self.o_proj = nn.Linear(H * self.V, D, bias=bias)
        # "fused": k2_kernels.ops.mla_attention, which returns the max logits with the output
        # (no score matrix); "sdpa": SDPA + a no-grad score pass for max logits; "eager": explicit
        # softmax whose score tensor gives the max logits. "auto": fused where a compiled kernel
        # serves the device and the mask is causal-within-documents; otherwise eager when
        # training on CPU (measured faster there), sdpa elsewhere.
        self.attn_impl = "auto"
        self.register_buffer("max_logits_H", torch.full((H,), -math.inf), persistent=False)

    def forward(
        self,
        x_BSD: Tensor,
        cos_BSR2: Tensor,
        sin_BSR2: Tensor,
        mask_BSL: Tensor | None,
        segments: PackedSegments | None = None,
    ) -> Tensor:
        B, S, _ = x_BSD.shape
        H, P, R, V = self.num_heads, self.P, self.R, self.V
        if self.config.q_lora_rank is None:
            q_BSHDh = self.q_proj(x_BSD).view(B, S, H, P + R)
        else:
            q_BSHDh = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD))).view(B, S, H, P + R)
        ckv_BSCR = self.kv_a_proj_with_mqa(x_BSD)
        c_BSC, k_rope_BSR = ckv_BSCR.split([self.C, R], dim=-1)
        kv_BSHX = self.kv_b_proj(self.kv_a_layernorm(c_BSC)).view(B, S, H, P + V)

        impl = self._resolve_impl(x_BSD.device, mask_BSL, segments)
        if impl == "fused":
            return self._fused_attention(q_BSHDh, kv_BSHX, k_rope_BSR, cos_BSR2, sin_BSR2, segments)

        q_BHSDh = q_BSHDh.transpose(1, 2)
        q_nope_BHSP, q_rope_BHSR = q_BHSDh.split([P, R], dim=-1)
        k_nope_BHSP, v_BHSV = kv_BSHX.transpose(1, 2).split([P, V], dim=-1)

        q_rope_BHSR = apply_rope_interleaved(q_rope_BHSR, cos_BSR2.unsqueeze(1), sin_BSR2.unsqueeze(1))
        k_rope_B1SR = apply_rope_interleaved(k_rope_BSR, cos_BSR2, sin_BSR2).unsqueeze(1)

        q_BHSDh = torch.cat((q_nope_BHSP, q_rope_BHSR), dim=-1)
        k_BHSDh = torch.cat((k_nope_BHSP, k_rope_B1SR.expand(B, H, S, R)), dim=-1)
        mask_B1SL = None if mask_BSL is None else mask_BSL.unsqueeze(1)

        if impl == "eager":
            o_BHSV = self._eager_attention(q_BHSDh, k_BHSDh, v_BHSV, mask_B1SL)
        else:
            if self.training:
                with torch.no_grad():
                    s_BHSL = torch.matmul(q_BHSDh, k_BHSDh.transpose(-1, -2))
                    s_BHSL.mul_(self.softmax_scale).add_(_mask_bias(mask_B1SL, S, x_BSD.device, s_BHSL.dtype))
                    self._record_max_logits(s_BHSL)
            if mask_B1SL is None:
                o_BHSV = F.scaled_dot_product_attention(
                    q_BHSDh, k_BHSDh, v_BHSV, is_causal=True, scale=self.softmax_scale
                )
            else:
                o_BHSV = F.scaled_dot_product_attention(
                    q_BHSDh, k_BHSDh, v_BHSV, attn_mask=mask_B1SL, scale=self.softmax_scale
                )
        return self.o_proj(o_BHSV.transpose(1, 2).reshape(B, S, H * V))

    def uses_fused(self, device: torch.device) -> bool:
        """Whether a causal-within-documents batch (given as segments) takes the fused kernel."""
        return self.attn_impl == "fused" or (
            self.attn_impl == "auto" and fused_attention_available(device, self.P + self.R, self.V)
        )

    def _resolve_impl(
        self, device: torch.device, mask_BSL: Tensor | None, segments: PackedSegments | None
    ) -> str:
        impl = self.attn_impl
        fusable = mask_BSL is None or segments is not None
        if impl == "fused" and not fusable:
            raise ValueError(
                "attention impl 'fused' handles causal attention within packed documents only; this "
                "batch has a padding mask (use impl 'auto', 'sdpa' or 'eager')"
            )
        if impl == "auto":
            if fusable and fused_attention_available(device, self.P + self.R, self.V):
                return "fused"
            return "eager" if self.training and device.type == "cpu" else "sdpa"
        return impl

    def _fused_attention(
        self,
        q_BSHDh: Tensor,
        kv_BSHX: Tensor,
        k_rope_BSR: Tensor,
        cos_BSR2: Tensor,
        sin_BSR2: Tensor,
        segments: PackedSegments | None,
    ) -> Tensor:
        """Tokens as one packed [T, H, *] batch through the fused kernel, which returns each head's
        max logit with the output (no score matrix, memory linear in S)."""
        B, S = q_BSHDh.shape[:2]
        H, P, R, V = self.num_heads, self.P, self.R, self.V
        T = B * S
        # RoPE and the packing into the kernel's contiguous q, k, v: one op (one C++ pass each way
        # on CPU) instead of ~20 small ones per layer
        q_THDh, k_THDh, v_THV = _kops.mla_rope_pack(
            q_BSHDh.reshape(T, H, P + R), kv_BSHX.reshape(T, H, P + V), k_rope_BSR.reshape(T, R),
            cos_BSR2.reshape(T, R // 2), sin_BSR2.reshape(T, R // 2), P,
        )  # fmt: skip
        if segments is None:  # plain causal: each row of the batch is one sequence
            segments = PackedSegments.rows(B, S, q_BSHDh.device)
        o_THV, _, max_logit_H = _kops.mla_attention(
            q_THDh, k_THDh, v_THV, segments.cu_seqlens, segments.max_seqlen, self.softmax_scale, causal=True
        )
        if self.training:
            self._record_max_logits(max_logit_H.detach().view(1, H, 1, 1))
        return self.o_proj(o_THV.reshape(B, S, H * V))

    def _eager_attention(
        self, q_BHSDh: Tensor, k_BHSDh: Tensor, v_BHSV: Tensor, mask_B1SL: Tensor | None
    ) -> Tensor:
        """Explicit softmax attention over causal query blocks.

        Query block [s0, s1) only needs keys [0, s1) (every mask here is causal), so computing
        scores block by block skips most of the upper triangle (37.5% of the score and PV FLOPs at
        4 blocks). The score tensor gives the max logits for free. Scale and mask are fused into
        one baddbmm: scores = scale * q k^T + (0 | -inf).
        """
        B, H, S, Dh = q_BHSDh.shape
        V = v_BHSV.shape[-1]
        q_ZSDh = q_BHSDh.reshape(B * H, S, Dh)  # Z = B * H
        k_ZSDh = k_BHSDh.reshape(B * H, S, Dh)
        v_ZSV = v_BHSV.reshape(B * H, S, V)
        bias_b1SL = _mask_bias(mask_B1SL, S, q_BHSDh.device, q_BHSDh.dtype)  # b = 1 or B
        block = max(64, -(-S // 8))
        outs = []
        for s0 in range(0, S, block):
            s1 = min(S, s0 + block)
            bias = bias_b1SL[:, :, s0:s1, :s1]
            bias = (
                bias[0] if bias.shape[0] == 1 else bias.expand(B, H, s1 - s0, s1).reshape(B * H, s1 - s0, s1)
            )
            scores_ZQL = torch.baddbmm(
                bias, q_ZSDh[:, s0:s1], k_ZSDh[:, :s1].transpose(1, 2), alpha=self.softmax_scale
            )
            if self.training:
                self._record_max_logits(scores_ZQL.detach().view(B, H, s1 - s0, s1))
            probs_ZQL = F.softmax(scores_ZQL, dim=-1, dtype=torch.float32).to(q_BHSDh.dtype)
            outs.append(torch.bmm(probs_ZQL, v_ZSV[:, :s1]))
        return torch.cat(outs, dim=1).view(B, H, S, V)

    @torch.no_grad()
    def _record_max_logits(self, scores_BHSL: Tensor) -> None:
        m_H = scores_BHSL.float().amax(dim=(0, 2, 3))
        torch.maximum(self.max_logits_H, m_H.to(self.max_logits_H.device), out=self.max_logits_H)


def fused_attention_available(device: torch.device, Dk: int, Dv: int) -> bool:
    """A compiled k2_kernels attention kernel serves this device and these head dims; on CPU also
    OpenBLAS (on the built-in GEMM the kernel is correct but slower than the masked paths)."""
    return _kops.preferred("mla_attention", device, head_dims=(Dk, Dv))


@dataclass
class PackedSegments:
    """The batch as packed sequences for the fused kernel: `cu_seqlens` (int32 [n + 1]) over the
    flattened B * S tokens, each sequence one document of one row (causal inside it)."""

    cu_seqlens: Tensor
    max_seqlen: int

    @staticmethod
    def rows(B: int, S: int, device: torch.device) -> PackedSegments:
        return PackedSegments(torch.arange(0, B * S + 1, S, dtype=torch.int32, device=device), S)

    @staticmethod
    def from_document_ids(document_ids_BS: Tensor) -> PackedSegments | None:
        """Documents as contiguous runs of equal ids in each row; None when an id reappears after
        another (the mask then is not a set of runs and the masked paths handle it)."""
        B, S = document_ids_BS.shape
        starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
        starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]  # every row starts a run
        # runs are distinct documents iff each row has as many runs as distinct ids
        sorted_BS = document_ids_BS.sort(dim=1).values
        distinct_B = (sorted_BS[:, 1:] != sorted_BS[:, :-1]).sum(1) + 1
        if not bool((starts_BS.sum(1) == distinct_B).all()):
            return None
        idx = starts_BS.reshape(-1).nonzero().flatten()
        cu = torch.cat((idx, idx.new_tensor([B * S]))).to(torch.int32)
        return PackedSegments(cu, int((cu[1:] - cu[:-1]).max()))


def _causal(S: int, device: torch.device) -> Tensor:
    return torch.ones(S, S, dtype=torch.bool, device=device).tril()


def _mask_bias(mask_B1SL: Tensor | None, S: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Additive mask: 0 where attention is allowed, -inf elsewhere ([B or 1, 1, S, S])."""
    allowed = mask_B1SL if mask_B1SL is not None else _causal(S, device)[None, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)


class DecoderLayer(nn.Module):
    def __init__(self, config: K2Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_idx)
        self.mlp: nn.Module = (
            MoE(config)
            if config.is_moe_layer(layer_idx)
            else MLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Set by k2_model.parallelize.apply_activation_checkpointing: recompute this layer in
        # backward instead of keeping its activations.
        self.activation_checkpointing = False

    def forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask_BSL: Tensor | None,
        segments: PackedSegments | None = None,
        recorded_BSK: Tensor | None = None,
    ) -> Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return checkpoint(
                self._forward,
                x_BSD,
                cos,
                sin,
                mask_BSL,
                segments,
                recorded_BSK,
                use_reentrant=False,
                context_fn=self._recompute_contexts,
            )
        return self._forward(x_BSD, cos, sin, mask_BSL, segments, recorded_BSK)

    def _forward(
        self,
        x_BSD: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask_BSL: Tensor | None,
        segments: PackedSegments | None,
        recorded_BSK: Tensor | None = None,
    ) -> Tensor:
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos, sin, mask_BSL, segments)
        if recorded_BSK is not None and isinstance(self.mlp, MoE):
            return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD), recorded_BSK)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))

    def _recompute_contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(forward, recompute) contexts of the checkpointed layer. The recompute runs in training
        mode, so the router would count its tokens into the expert loads a second time; the
        recompute context restores the loads (and the routing-mismatch counts). (The max logits it re-records are the same values,
        and a max is unchanged by a repeat.)"""
        return contextlib.nullcontext(), _keep_expert_loads(
            self.mlp.gate if isinstance(self.mlp, MoE) else None
        )


@contextlib.contextmanager
def _keep_expert_loads(router: Router | None):
    """Undo what a recompute adds to the router's counts (expert loads, routing mismatch)."""
    saved = None if router is None else (router.expert_load.clone(), router.route_mismatch.clone())
    try:
        yield
    finally:
        if router is not None:
            router.expert_load.copy_(saved[0])
            router.route_mismatch.copy_(saved[1])


class K2Model(nn.Module):
    """Embeddings, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config: K2Config) -> None:
        super().__init__()
        self.config = config
        # As transformers: the pad row gets no gradient (padding_idx) and starts at zero.
        pad = config.pad_token_id
        self.padding_idx = pad if pad is not None and 0 <= pad < config.vocab_size else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq, self.rope_attention_factor = rope_inv_freq(config)
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    def forward(
        self,
        input_ids_BS: Tensor,
        position_ids_BS: Tensor | None = None,
        attention_mask_BS: Tensor | None = None,
        document_ids_BS: Tensor | None = None,
        routed_experts_BSLK: Tensor | None = None,
    ) -> Tensor:
        B, S = input_ids_BS.shape
        device = input_ids_BS.device
        # layer i's recorded experts [B, S, K], if any (j-th MoE layer: routed_experts[:, :, j])
        per_layer: list[Tensor | None] = [None] * len(self.layers)
        if routed_experts_BSLK is not None:
            moe = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, MoE)]
            for j, i in enumerate(moe):
                per_layer[i] = routed_experts_BSLK[:, :, j]

        if position_ids_BS is None:
            position_ids_BS = torch.arange(S, device=device).unsqueeze(0).expand(B, S)
        cos, sin = rope_cos_sin(self.rope_inv_freq, position_ids_BS, self.rope_attention_factor)
        # The fused kernel takes causal-within-documents as packed sequences; padding masks are
        # not that shape, so those batches take the masked paths. The [B, S, S] mask is built only
        # when some layer needs it, so fused training stays linear in S with documents too.
        segments = None
        if attention_mask_BS is not None and attention_mask_BS.dim() == 3:
            # an explicit [B, S, L] "may attend" matrix (e.g. K responses sharing one prompt): it
            # is taken as given, plus the diagonal so no softmax row is empty
            if attention_mask_BS.shape != (B, S, S) or document_ids_BS is not None:
                raise ValueError(
                    f"a 3-D attention_mask must be [batch, seq, seq] = {(B, S, S)} without document_ids, "
                    f"got {tuple(attention_mask_BS.shape)}"
                )
            mask_BSL = attention_mask_BS.bool() | torch.eye(S, dtype=torch.bool, device=device)
            h_BSD = self.embed_tokens(input_ids_BS)
            for i, layer in enumerate(self.layers):
                h_BSD = layer(h_BSD, cos, sin, mask_BSL, None, per_layer[i])
            return self.norm(h_BSD)
        if document_ids_BS is not None and attention_mask_BS is None:
            segments = PackedSegments.from_document_ids(document_ids_BS)
        elif document_ids_BS is None and attention_mask_BS is None:  # plain causal: a row, a sequence
            segments = PackedSegments.rows(B, S, device)
        mask_BSL = None
        if segments is None or not all(layer.self_attn.uses_fused(device) for layer in self.layers):
            mask_BSL = build_attention_mask(S, device, attention_mask_BS, document_ids_BS)
        h_BSD = self.embed_tokens(input_ids_BS)
        for i, layer in enumerate(self.layers):
            h_BSD = layer(h_BSD, cos, sin, mask_BSL, segments, per_layer[i])
        return self.norm(h_BSD)


def build_attention_mask(
    S: int, device: torch.device, attention_mask_BS: Tensor | None, document_ids_BS: Tensor | None
) -> Tensor | None:
    """Boolean [B, S, L] mask (True = may attend): causal, same document, key not padding.

    None means plain causal (the fast path). Each query may always see itself so no softmax row
    is empty (padded queries' outputs are meaningless and excluded from the loss by labels).
    """
    if attention_mask_BS is None and document_ids_BS is None:
        return None
    allowed_BSL = _causal(S, device).unsqueeze(0)
    if document_ids_BS is not None:
        allowed_BSL = allowed_BSL & (document_ids_BS.unsqueeze(2) == document_ids_BS.unsqueeze(1))
    if attention_mask_BS is not None:
        allowed_BSL = allowed_BSL & attention_mask_BS.bool().unsqueeze(1)
    return allowed_BSL | torch.eye(S, dtype=torch.bool, device=device)


@dataclass
class K2CausalLMOutput:
    logits: Tensor
    loss: Tensor | None = None


class K2ForCausalLM(nn.Module):
    """The K2 / DeepSeek-V3 causal LM with an untied head.

    Training-loop duties (documented in the README):
      * after each optimizer step call `update_expert_bias(step_size)`, which all-reduces the
        per-expert token counts of the step (when torch.distributed is initialised) and moves the
        selection bias by `step_size * sign(mean_load - load)`;
      * QK-Clip (k2-optim) reads `attention_max_logits()` and `qk_clip_layers()` after the step
        and calls `reset_attention_max_logits()`.
    """

    def __init__(self, config: K2Config) -> None:
        super().__init__()
        self.config = config
        self.model = K2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' init: N(0, initializer_range) for matrices, ones for norms, zero bias."""
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, Router):
                nn.init.normal_(m.weight, 0.0, std)
            elif isinstance(m, RoutedExperts):
                for p in (m.gate_proj, m.up_proj, m.down_proj):
                    nn.init.normal_(p, 0.0, std)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty`, e.g. when loading a checkpoint)."""
        device = self.lm_head.weight.device
        inv_freq, _ = rope_inv_freq(self.config, device=device)
        self.model.rope_inv_freq = inv_freq
        for m in self.modules():
            if isinstance(m, Router):
                m.expert_load.zero_()
                m.route_mismatch.zero_()
            elif isinstance(m, MLAttention):
                m.max_logits_H.fill_(-math.inf)

    def set_expert_qat(self, group_size: int, bits: int = 4) -> None:
        """INT4 quantisation-aware training of the routed experts: every forward uses the weights an
        INT4 export (groups of `group_size`) would load, gradients pass straight through to the
        full-precision weights; 0 turns it off. `bits` 3 or 2: the same rule at a coarser width
        (`k2_model.int4.fake_quantize_int`; no export format)."""
        from k2_model.moe import RoutedExperts

        if group_size < 0:
            raise ValueError(f"set_expert_qat: group_size must be >= 0, got {group_size}")
        if not 2 <= bits <= 8:
            raise ValueError(f"set_expert_qat: bits must be in [2, 8], got {bits}")
        for m in self.modules():
            if isinstance(m, RoutedExperts):
                m.qat_group_size, m.qat_bits = group_size, bits

    def set_routing_replay(self, enabled: bool) -> None:
        """Route every MoE layer by the experts passed as `routed_experts` (where a token has a
        record) instead of its own top-k: the trainer then runs exactly the experts the rollout
        engine ran. Gradients reach the gate through the chosen experts' weights as usual."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.replay_routing = bool(enabled)

    def routing_mismatch(self) -> Tensor:
        """float32 [num_moe_layers, 2]: (tokens whose top-k set differed from `routed_experts`,
        tokens with a record) per MoE layer, over the forwards since `reset_routing_mismatch()`."""
        routers = self.moe_routers()
        if not routers:
            return torch.zeros(0, 2)
        return torch.stack([r.route_mismatch for r in routers])

    def reset_routing_mismatch(self) -> None:
        for r in self.moe_routers():
            r.route_mismatch.zero_()

    def set_attention_impl(self, impl: str) -> None:
        if impl not in ("auto", "fused", "sdpa", "eager"):
            raise ValueError(f"attention impl must be 'auto', 'fused', 'sdpa' or 'eager', got {impl!r}")
        for m in self.modules():
            if isinstance(m, MLAttention):
                m.attn_impl = impl

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        shift_labels: Tensor | None = None,
        logits_mask: Tensor | None = None,
        routed_experts: Tensor | None = None,
    ) -> K2CausalLMOutput:
        """Logits [B, S, N]; with targets, the mean next-token cross-entropy (ignore_index -100).

        Targets come in one of two conventions, as in transformers: `labels` [B, S] are the input
        tokens (position t is scored against labels[t + 1]; the model shifts), `shift_labels`
        [B, S] are already the next tokens (position t against shift_labels[t]; k2-data's loader
        yields these, so `model(**batch).loss` is the training loss). Passing both is an error.
        `attention_mask` [B, S]: 1 = token, 0 = padding; or [B, S, S] bool, True where query s may
        attend key l, taken as given (K2's RL trainer packs K responses after one shared prompt
        this way; such batches take the masked attention paths). `document_ids` [B, S]: packed sequences
        attend only within their document (pass position_ids that restart per document too).
        `logits_mask` [B, S] bool: apply the head only where True; logits come back [K, N] for
        the K kept positions in row-major order (and the loss, if any, is over those). SFT trains
        ~5% of its tokens, and the vocab projection with its softmax is a third of a small
        model's step: skipping the untrained positions saves it (HF's `logits_to_keep`, by mask).
        `routed_experts` [B, S, num_moe_layers, K] int: the experts a rollout engine chose for each
        token (-1 where it has none): every MoE layer counts where its own choice differs
        (`routing_mismatch()`), and after `set_routing_replay(True)` routes by the record
        (RL routing replay: k2_rl.routing).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if labels is not None and shift_labels is not None:
            raise ValueError(
                "pass either labels (unshifted, HF convention) or shift_labels (next tokens), not both"
            )
        for name, t in (("labels", labels), ("shift_labels", shift_labels)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} != input_ids shape {tuple(input_ids.shape)}")
        if logits_mask is not None and (
            logits_mask.shape != input_ids.shape or logits_mask.dtype != torch.bool
        ):
            raise ValueError(
                f"logits_mask must be a bool tensor shaped like input_ids {tuple(input_ids.shape)}, "
                f"got {logits_mask.dtype} {tuple(logits_mask.shape)}"
            )
        if routed_experts is not None:
            want = (*input_ids.shape, len(self.moe_routers()), self.config.num_experts_per_tok)
            if tuple(routed_experts.shape) != want:
                raise ValueError(
                    f"routed_experts must be [batch, seq, moe layers, experts per token] = {want}, "
                    f"got {tuple(routed_experts.shape)}"
                )
        h_BSD = self.model(input_ids, position_ids, attention_mask, document_ids, routed_experts)
        loss = None
        if labels is not None:  # position t predicts labels[t + 1]
            shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
        if logits_mask is not None:
            logits_KN = self.lm_head(h_BSD[logits_mask])
            if shift_labels is not None:
                loss = F.cross_entropy(logits_KN.float(), shift_labels[logits_mask], ignore_index=-100)
            return K2CausalLMOutput(logits=logits_KN, loss=loss)
        logits_BSN = self.lm_head(h_BSD)
        if shift_labels is not None:
            loss = F.cross_entropy(
                logits_BSN.float().reshape(-1, logits_BSN.shape[-1]),
                shift_labels.reshape(-1),
                ignore_index=-100,
            )
        return K2CausalLMOutput(logits=logits_BSN, loss=loss)

    # ------------------------------------------------------------------ aux-loss-free balancing
    def moe_routers(self) -> list[Router]:
        return [m.gate for m in self.modules() if isinstance(m, MoE)]

    def expert_load(self) -> Tensor:
        """[num_moe_layers, E] tokens routed per expert since the last `update_expert_bias` (this rank)."""
        routers = self.moe_routers()
        if not routers:
            return torch.zeros(0, self.config.n_routed_experts)
        return torch.stack([r.expert_load for r in routers])

    @torch.no_grad()
    def update_expert_bias(self, step_size: float = 1e-3) -> Tensor:
        """Aux-loss-free balancing step; call once after each optimizer step.

        Sums the recorded token counts over data-parallel ranks (all-reduce when torch.distributed
        is initialised), moves each layer's bias by `step_size * sign(mean_load - load)` (toward
        under-loaded experts), resets the counts, and returns the global loads [layers, E].
        """
        routers = self.moe_routers()
        if not routers:
            return torch.zeros(0, self.config.n_routed_experts)
        load_LE = torch.stack([r.expert_load for r in routers])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(load_LE)
        delta_LE = step_size * torch.sign(load_LE.mean(dim=-1, keepdim=True) - load_LE)
        for i, r in enumerate(routers):
            r.e_score_correction_bias += delta_LE[i].to(r.e_score_correction_bias.device)
            r.expert_load.zero_()
        return load_LE

    # ------------------------------------------------------------------ QK-Clip protocol
    def _attentions(self) -> list[MLAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def attention_max_logits(self) -> Tensor:
        """float32 [num_layers, num_heads]: max pre-softmax logit per head over training forwards
        since the last reset (-inf where no training forward ran)."""
        return torch.stack([a.max_logits_H.float() for a in self._attentions()])

    def reset_attention_max_logits(self) -> None:
        for a in self._attentions():
            a.max_logits_H.fill_(-math.inf)

    def qk_clip_layers(self) -> list[dict[str, Any]]:
        """Which rows of which weights belong to each head (see the QK-Clip protocol in k2-optim)."""
        cfg = self.config
        P, R, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        out = []
        for i, a in enumerate(self._attentions()):
            q_w = a.q_proj.weight if cfg.q_lora_rank is None else a.q_b_proj.weight
            out.append(
                {
                    "name": f"model.layers.{i}.self_attn",
                    "num_heads": a.num_heads,
                    "spans": [
                        {"param": q_w, "stride": P + R, "start": 0, "length": P, "power": 0.5},
                        {"param": q_w, "stride": P + R, "start": P, "length": R, "power": 1.0},
                        {"param": a.kv_b_proj.weight, "stride": P + V, "start": 0, "length": P, "power": 0.5},
                    ],
                }
            )
        return out

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> K2ForCausalLM:
        """Load an HF-format directory (config.json + safetensors; FP8 block and INT4
        pack-quantized weights dequantised on load)."""
        return load_pretrained(cls, path, dtype=dtype, device=device)

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 2**30, quantize: Any = None) -> None:
        """Write config.json + (sharded, indexed) safetensors with DeepseekV3ForCausalLM names;
        `quantize=k2_model.int4.Int4Format()`: routed experts in INT4 (K2-Thinking's layout)."""
        save_pretrained(self, path, max_shard_bytes=max_shard_bytes, quantize=quantize)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
