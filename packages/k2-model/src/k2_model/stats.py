"""The K2 cost model: exact parameter counts, FLOPs, KV-cache and per-EP-rank weight bytes from a K2Config.

Everything here is closed-form arithmetic on the config (no model is built), so it runs instantly
for the 1T-parameter `kimi-k2` preset. Conventions (COST_MODEL.md explains each, with numbers):

- Parameters are counted exactly as the model (and transformers' DeepseekV3ForCausalLM) holds
  them: no MTP layer (reported separately), the router's selection bias is a buffer, not counted.
- Active parameters per token, two conventions:
  `active_params` (HF/paper style): everything a token's forward pass reads, counting the whole
  embedding table and LM head, but only `num_experts_per_tok` of the routed experts.
  `active_params_no_embedding`: the same minus the input embedding table (a lookup, no FLOPs).
- FLOPs: 2 FLOPs per multiply-accumulate. The "linear" part is 2 x every active weight that takes
  part in a matmul (attention projections, MLPs, active experts, router, LM head; not the input
  embedding, not the RMSNorm weights). Attention core = QK^T scores + the weighted sum of V.
  Softmax, RMSNorm, RoPE, SwiGLU's elementwise product and the routing top-k are not counted.
- Prefill at context s: the mean over the s positions of a causal sequence; position i attends to
  i keys, so the mean is (s+1)/2 keys per query. The seed's formula 2*h*s^2*(d_nope+d_rope+d_v)
  per layer (no causal mask) is reported too, as `prefill_full_*`.
- Decode at context s: one new token attending to s cached positions (itself included), either
  "naive" (K and V expanded per head: scores over qk_head_dim, values over v_head_dim) or
  "absorbed" (MLA's W_UK folded into the query and W_UV into the output: scores over the
  kv_lora_rank + qk_rope_head_dim latent, values over kv_lora_rank). The absorption matmuls cost
  exactly what kv_b_proj would on the new token, so both forms have the same linear part.
- KV cache per token: compressed = (kv_lora_rank + qk_rope_head_dim) per layer; expanded =
  heads * (qk_head_dim + v_head_dim) per layer; both at `kv_dtype_bytes` (2: bf16).
- Per-EP-rank expert weights: FP8, one byte per weight; per MoE layer a rank holds
  ceil(n_routed_experts / ep) routed experts plus every shared expert (replicated). Dense-layer
  MLPs and attention (replicated under DP attention) are reported beside it, not in it.

Legend for names: L = layers, D = hidden_size, H = attention heads, E = routed experts,
K = experts per token, F = dense FFN width, Fe = expert FFN width, s = context length.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from k2_model.config import K2Config

BF16_BYTES = 2
FP8_BYTES = 1
FP8_BLOCK = 128  # released checkpoints: one fp32 weight_scale_inv per 128x128 block
SCALE_BYTES = 4

# Paper / seed numbers the `--compare` report prints next to ours. Sources: the Kimi K2 report
# (arXiv:2507.20534, Table 2 and section 2.3) and the inference engineer's account (seed 003).
PAPER_REFERENCE: dict[str, dict[str, Any]] = {
    "kimi-k2": {
        "total_params": 1.04e12,
        "active_params": 32.6e9,
        "qkvo_params": 5e9,
        "ep128_rank_bytes": 10e9,
    },
    "deepseek-v3": {
        "total_params": 671e9,
        "active_params": 37e9,
        "qkvo_params": 10e9,
        "ep128_rank_bytes": 7.5e9,
    },
    # 128 instead of 64 heads (384 experts kept) at 128K context: +83% inference FLOPs.
    "heads_128_vs_64_flops_increase": 0.83,
    "heads_context": 131072,
}


# ---------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamCount:
    """Parameters of one category: all of them, and the ones one token reads."""

    total: int
    active: int


@dataclass(frozen=True)
class AttentionParams:
    """One MLA layer's parameters by projection (0 where the config does not have it)."""

    q_a: int  # hidden -> q_lora_rank (with q_lora_rank)
    q_b: int  # q_lora_rank -> H*qk_head_dim, or q_proj hidden -> H*qk_head_dim without it
    kv_a: int  # hidden -> kv_lora_rank + qk_rope_head_dim (latent + the shared rotary key)
    kv_b: int  # kv_lora_rank -> H*(qk_nope_head_dim + v_head_dim)
    o: int  # H*v_head_dim -> hidden
    norms: int  # q_a_layernorm + kv_a_layernorm

    @property
    def projections(self) -> int:
        return self.q_a + self.q_b + self.kv_a + self.kv_b + self.o

    @property
    def head_projections(self) -> int:
        """The projections whose size is proportional to the head count (the seed's 'QKVO')."""
        return self.q_b + self.kv_b + self.o


def attention_layer_params(cfg: K2Config) -> AttentionParams:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    bias = 1 if cfg.attention_bias else 0
    q_out = H * cfg.qk_head_dim
    if cfg.q_lora_rank is not None:
        q_a = D * cfg.q_lora_rank + bias * cfg.q_lora_rank
        q_b = cfg.q_lora_rank * q_out
        q_norm = cfg.q_lora_rank
    else:
        q_a, q_b, q_norm = 0, D * q_out, 0
    kv_a_out = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    kv_a = D * kv_a_out + bias * kv_a_out
    kv_b = cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = H * cfg.v_head_dim * D + bias * D
    return AttentionParams(q_a=q_a, q_b=q_b, kv_a=kv_a, kv_b=kv_b, o=o, norms=q_norm + cfg.kv_lora_rank)


def expert_params(cfg: K2Config) -> int:
    """One SwiGLU expert: gate, up (D x Fe) and down (Fe x D)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def dense_mlp_params(cfg: K2Config) -> int:
    return 3 * cfg.hidden_size * cfg.intermediate_size


def num_moe_layers(cfg: K2Config) -> int:
    return sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))


@dataclass(frozen=True)
class ParamBreakdown:
    """Exact parameter counts by category; the categories sum to the model's parameter count."""

    embeddings: ParamCount
    attention: ParamCount  # all attention projections (q_a, q_b, kv_a, kv_b, o)
    dense_mlp: ParamCount
    shared_experts: ParamCount
    routed_experts: ParamCount
    router: ParamCount
    norms: ParamCount  # layer norms, the q_a/kv_a norms and the final norm
    lm_head: ParamCount
    attention_head_projections: int  # q_b (or q_proj), kv_b, o: part of `attention`
    attention_layer: AttentionParams
    mtp_layer: int  # one multi-token-prediction layer (not part of the model), embeddings shared

    CATEGORIES = (
        "embeddings", "attention", "dense_mlp", "shared_experts", "routed_experts", "router", "norms", "lm_head",
    )  # fmt: skip

    def rows(self) -> list[tuple[str, ParamCount]]:
        return [(name, getattr(self, name)) for name in self.CATEGORIES]

    @property
    def total_params(self) -> int:
        return sum(c.total for _, c in self.rows())

    @property
    def active_params(self) -> int:
        """HF/paper style: whole embedding table and LM head counted, K of E routed experts."""
        return sum(c.active for _, c in self.rows())

    @property
    def active_params_no_embedding(self) -> int:
        """Active parameters without the input embedding table (a lookup costs no FLOPs)."""
        return self.active_params - self.embeddings.active

    @property
    def active_matmul_params(self) -> int:
        """Active weights that take part in a matmul: the '2N' of the FLOPs count."""
        return self.active_params - self.embeddings.active - self.norms.active


def param_breakdown(cfg: K2Config) -> ParamBreakdown:
    D, L = cfg.hidden_size, cfg.num_hidden_layers
    n_moe = num_moe_layers(cfg)
    n_dense = L - n_moe
    attn = attention_layer_params(cfg)
    expert = expert_params(cfg)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok

    def full(n: int) -> ParamCount:
        return ParamCount(n, n)

    embeddings = cfg.vocab_size * D
    norms = L * (2 * D + attn.norms) + D
    routed_total = n_moe * E * expert
    # MTP layer as in DeepSeek-V3: enorm + hnorm, eh_proj (2D -> D), a full MoE decoder layer and
    # the shared head's norm; its embedding and LM head are the main model's.
    mtp_layer = 2 * D + 2 * D * D + attn.projections + attn.norms + 2 * D
    mtp_layer += (E + cfg.n_shared_experts) * expert + E * D + D
    return ParamBreakdown(
        embeddings=full(embeddings),
        attention=full(L * attn.projections),
        dense_mlp=full(n_dense * dense_mlp_params(cfg)),
        shared_experts=full(n_moe * cfg.n_shared_experts * expert),
        routed_experts=ParamCount(routed_total, n_moe * K * expert),
        router=full(n_moe * E * D),
        norms=full(norms),
        lm_head=full(cfg.vocab_size * D),
        attention_head_projections=L * attn.head_projections,
        attention_layer=attn,
        mtp_layer=mtp_layer,
    )


# ---------------------------------------------------------------------------------- FLOPs
@dataclass(frozen=True)
class FlopsPerToken:
    """Forward FLOPs per token at a context length (2 FLOPs per multiply-accumulate)."""

    context: int
    linear: int  # 2 x active matmul weights, identical for prefill and decode
    prefill_attention: int  # causal: mean over the sequence's positions, (s+1)/2 keys each
    prefill_full_attention: int  # the seed's 2*h*s^2*d per layer per sequence, i.e. s keys each
    decode_attention_naive: int  # expanded K/V heads, s keys
    decode_attention_absorbed: int  # MLA absorbed: scores and values over the latent, s keys

    @property
    def prefill(self) -> int:
        return self.linear + self.prefill_attention

    @property
    def prefill_full(self) -> int:
        return self.linear + self.prefill_full_attention

    @property
    def decode_naive(self) -> int:
        return self.linear + self.decode_attention_naive

    @property
    def decode_absorbed(self) -> int:
        return self.linear + self.decode_attention_absorbed


def flops_per_token(cfg: K2Config, context: int) -> FlopsPerToken:
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive int (tokens), got {context!r}")
    L, H, s = cfg.num_hidden_layers, cfg.num_attention_heads, context
    d_naive = cfg.qk_head_dim + cfg.v_head_dim  # per key: score over qk_head_dim, value over v_head_dim
    d_absorbed = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    linear = 2 * param_breakdown(cfg).active_matmul_params
    # sum_{i=1..s} 2*H*i*d = H*d*s*(s+1) per layer per sequence; per token divide by s (exact).
    prefill = L * H * d_naive * (s + 1)
    return FlopsPerToken(
        context=s,
        linear=linear,
        prefill_attention=prefill,
        prefill_full_attention=2 * L * H * d_naive * s,
        decode_attention_naive=2 * L * H * d_naive * s,
        decode_attention_absorbed=2 * L * H * d_absorbed * s,
    )


# ---------------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class KVCacheBytes:
    """KV-cache bytes per token, summed over layers."""

    dtype_bytes: int
    compressed: int  # MLA: the kv latent + the shared rotary key
    expanded: int  # per-head K (qk_head_dim) and V (v_head_dim), as an MHA cache would hold them

    @property
    def ratio(self) -> float:
        return self.expanded / self.compressed


def kv_cache_bytes_per_token(cfg: K2Config, dtype_bytes: int = BF16_BYTES) -> KVCacheBytes:
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    return KVCacheBytes(
        dtype_bytes=dtype_bytes,
        compressed=L * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes,
        expanded=L * H * (cfg.qk_head_dim + cfg.v_head_dim) * dtype_bytes,
    )


def _block_scales(rows: int, cols: int) -> int:
    return math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)


@dataclass(frozen=True)
class EPRankBytes:
    """Expert weight bytes one expert-parallel rank holds (FP8: one byte per weight)."""

    ep: int
    routed_experts_per_layer: int  # ceil(E / ep): the fullest rank when ep does not divide E
    evenly_divided: bool
    moe_layers: int
    routed_bytes: int
    shared_bytes: int
    block_scale_bytes: int  # fp32 128x128 block scales of those experts (not in expert_bytes)
    dense_mlp_bytes: int  # dense first-k layers, replicated on every rank (not in expert_bytes)
    attention_bytes: int  # attention projections, replicated under DP attention (not in expert_bytes)

    @property
    def expert_bytes(self) -> int:
        """The seed's 'MLP weights per EP rank': routed experts + the replicated shared expert."""
        return self.routed_bytes + self.shared_bytes


def ep_rank_bytes(cfg: K2Config, ep: int, weight_bytes: int = FP8_BYTES) -> EPRankBytes:
    E = cfg.n_routed_experts
    if isinstance(ep, bool) or not isinstance(ep, int) or not 1 <= ep <= E:
        raise ValueError(
            f"ep (expert-parallel ranks) must be an int in [1, n_routed_experts={E}], got {ep!r}"
        )
    n_moe = num_moe_layers(cfg)
    per_layer = -(-E // ep)
    n_experts = n_moe * (per_layer + cfg.n_shared_experts)
    D, Fe = cfg.hidden_size, cfg.moe_intermediate_size
    scales_per_expert = 2 * _block_scales(Fe, D) + _block_scales(D, Fe)
    b = param_breakdown(cfg)
    return EPRankBytes(
        ep=ep,
        routed_experts_per_layer=per_layer,
        evenly_divided=E % ep == 0,
        moe_layers=n_moe,
        routed_bytes=n_moe * per_layer * expert_params(cfg) * weight_bytes,
        shared_bytes=n_moe * cfg.n_shared_experts * expert_params(cfg) * weight_bytes,
        block_scale_bytes=n_experts * scales_per_expert * SCALE_BYTES,
        dense_mlp_bytes=b.dense_mlp.total * weight_bytes,
        attention_bytes=b.attention.total * weight_bytes,
    )


INT4_GROUP = 32  # K2-Thinking: one bf16 scale per 32 INT4 weights


@dataclass(frozen=True)
class ServingBytes:
    """A checkpoint format's weight bytes: the whole model (what must fit) and what one decoded
    token reads (its active weights: the bandwidth bound of decode at batch 1)."""

    name: str
    total_bytes: int
    active_bytes: int  # per token: the K routed experts of every MoE layer and everything else


def serving_bytes(cfg: K2Config) -> list[ServingBytes]:
    """bf16 everywhere; FP8 as Kimi-K2-Instruct ships it (every linear weight 1 byte + fp32
    128x128 block scales; embeddings, head and norms bf16); INT4 experts as K2-Thinking ships them
    (routed experts 4 bits + a bf16 scale per 32 weights; the rest bf16)."""
    b = param_breakdown(cfg)
    D, Fe = cfg.hidden_size, cfg.moe_intermediate_size
    total, active = b.total_params, b.active_params
    routed_total, routed_active = b.routed_experts.total, b.routed_experts.active
    bf16 = ServingBytes("bf16", total * BF16_BYTES, active * BF16_BYTES)
    # FP8: the linear weights (everything but embeddings, LM head and norms) at one byte + scales
    linear_total = total - b.embeddings.total - b.lm_head.total - b.norms.total
    linear_active = active - b.embeddings.active - b.lm_head.active - b.norms.active
    per_expert_scales = 2 * _block_scales(Fe, D) + _block_scales(D, Fe)
    expert = expert_params(cfg)
    scale_frac = per_expert_scales * SCALE_BYTES / expert  # scale bytes per weight byte, ~2.4e-4
    fp8 = ServingBytes(
        "FP8 (128x128 blocks)",
        int(linear_total * (FP8_BYTES + scale_frac) + (total - linear_total) * BF16_BYTES),
        int(linear_active * (FP8_BYTES + scale_frac) + (active - linear_active) * BF16_BYTES),
    )
    int4_per_weight = 0.5 + BF16_BYTES / INT4_GROUP  # 4 bits + a bf16 scale per group
    int4 = ServingBytes(
        "INT4 routed experts (groups of 32), rest bf16",
        int(routed_total * int4_per_weight + (total - routed_total) * BF16_BYTES),
        int(routed_active * int4_per_weight + (active - routed_active) * BF16_BYTES),
    )
    return [bf16, fp8, int4]


# ---------------------------------------------------------------------------------- report
@dataclass(frozen=True)
class ModelStats:
    name: str
    config: K2Config
    params: ParamBreakdown
    flops: FlopsPerToken
    kv: KVCacheBytes
    ep: EPRankBytes

    @property
    def total_params(self) -> int:
        return self.params.total_params

    @property
    def active_params(self) -> int:
        return self.params.active_params

    def to_dict(self) -> dict[str, Any]:
        p, f = self.params, self.flops
        return {
            "name": self.name,
            "total_params": p.total_params,
            "active_params": p.active_params,
            "active_params_no_embedding": p.active_params_no_embedding,
            "active_matmul_params": p.active_matmul_params,
            "mtp_layer_params": p.mtp_layer,
            "params": {name: dataclasses.asdict(c) for name, c in p.rows()},
            "attention_head_projection_params": p.attention_head_projections,
            "attention_layer_params": dataclasses.asdict(p.attention_layer),
            "flops_per_token": {
                "context": f.context,
                "linear": f.linear,
                "prefill": f.prefill,
                "prefill_attention": f.prefill_attention,
                "prefill_full": f.prefill_full,
                "decode_naive": f.decode_naive,
                "decode_absorbed": f.decode_absorbed,
            },
            "kv_cache_bytes_per_token": dataclasses.asdict(self.kv),
            "ep_rank_bytes": {**dataclasses.asdict(self.ep), "expert_bytes": self.ep.expert_bytes},
            "serving_bytes": [dataclasses.asdict(x) for x in serving_bytes(self.config)],
        }


def model_stats(
    cfg: K2Config, context: int = 131072, ep: int = 128, name: str = "model", kv_dtype_bytes: int = BF16_BYTES
) -> ModelStats:
    return ModelStats(
        name=name,
        config=cfg,
        params=param_breakdown(cfg),
        flops=flops_per_token(cfg, context),
        kv=kv_cache_bytes_per_token(cfg, kv_dtype_bytes),
        ep=ep_rank_bytes(cfg, ep),
    )


@dataclass(frozen=True)
class Comparison:
    """One line of the side-by-side report: ours for A and B, and the paper's where it has one."""

    key: str
    label: str
    unit: str  # "params", "flops", "bytes"
    ours_a: float
    ours_b: float
    paper_a: float | None = None
    paper_b: float | None = None
    note: str = ""

    @property
    def ours_change(self) -> float:
        """B relative to A: +0.83 means B is 83% more than A."""
        return self.ours_b / self.ours_a - 1.0

    @property
    def paper_change(self) -> float | None:
        if self.paper_a is None or self.paper_b is None:
            return None
        return self.paper_b / self.paper_a - 1.0


def seed_comparisons(
    a: K2Config, b: K2Config, context: int = 131072, ep: int = 128, a_name: str = "A", b_name: str = "B"
) -> list[Comparison]:
    """The seed's comparisons of A (K2) and B (DeepSeek-V3), each with the paper's number when the
    pair is kimi-k2 vs deepseek-v3 (and, for numbers the paper gives at 128K / EP=128, those settings).
    """
    known = a_name in PAPER_REFERENCE and b_name in PAPER_REFERENCE
    ref_a = PAPER_REFERENCE.get(a_name, {}) if known else {}
    ref_b = PAPER_REFERENCE.get(b_name, {}) if known else {}
    pa, pb = param_breakdown(a), param_breakdown(b)
    out: list[Comparison] = []

    # The paper's head ablation: A as it is vs A with B's head count (experts and all else kept).
    a_heads = a.replace(num_attention_heads=b.num_attention_heads, num_key_value_heads=b.num_attention_heads)
    fa, fh = flops_per_token(a, context), flops_per_token(a_heads, context)
    at_paper_ctx = context == PAPER_REFERENCE["heads_context"]
    heads_ref = (
        (1.0, 1.0 + PAPER_REFERENCE["heads_128_vs_64_flops_increase"]) if known and at_paper_ctx else None
    )
    tag = f"{a_name} {a.num_attention_heads} vs {b.num_attention_heads} heads"
    out.append(Comparison(
        "heads_prefill_flops", f"{tag}: prefill FLOPs/token, causal", "flops", fa.prefill, fh.prefill,
        *(heads_ref or (None, None)),
        note=f"context {context}; mean over a causal sequence",
    ))  # fmt: skip
    out.append(Comparison(
        "heads_prefill_full_flops", f"{tag}: prefill FLOPs/token, no mask (2hs^2d)", "flops",
        fa.prefill_full, fh.prefill_full, *(heads_ref or (None, None)),
        note="the seed's formula: every query attends to all s keys",
    ))  # fmt: skip
    out.append(Comparison(
        "heads_decode_flops", f"{tag}: decode FLOPs/token, absorbed MLA", "flops",
        fa.decode_absorbed, fh.decode_absorbed, note=f"one token over a {context}-token cache",
    ))  # fmt: skip
    out.append(Comparison(
        "qkvo_params", "QKVO projections (q_b, kv_b, o)", "params",
        pa.attention_head_projections, pb.attention_head_projections,
        ref_a.get("qkvo_params"), ref_b.get("qkvo_params"),
        note="the head-proportional projections; the seed's '10B vs 5B'",
    ))  # fmt: skip
    out.append(Comparison(
        "attention_params", "all attention projections (+ q_a, kv_a)", "params",
        pa.attention.total, pb.attention.total, note="adds the head-independent down-projections",
    ))  # fmt: skip
    ea, eb = ep_rank_bytes(a, ep), ep_rank_bytes(b, ep)
    ep_known = known and ep == 128
    out.append(Comparison(
        "ep_rank_expert_bytes", f"MLP weights per EP rank at EP={ep} (FP8)", "bytes",
        ea.expert_bytes, eb.expert_bytes,
        ref_a.get("ep128_rank_bytes") if ep_known else None, ref_b.get("ep128_rank_bytes") if ep_known else None,
        note=f"{ea.routed_experts_per_layer} vs {eb.routed_experts_per_layer} routed + "
        f"{a.n_shared_experts} vs {b.n_shared_experts} shared per MoE layer",
    ))  # fmt: skip
    out.append(Comparison(
        "active_params", "active parameters per token", "params", pa.active_params, pb.active_params,
        ref_a.get("active_params"), ref_b.get("active_params"), note="embedding table and LM head included",
    ))  # fmt: skip
    out.append(Comparison(
        "total_params", "total parameters", "params", pa.total_params, pb.total_params,
        ref_a.get("total_params"), ref_b.get("total_params"),
        note=f"with one MTP layer (the paper's 1.04T counts one): {a_name} "
        f"{pa.total_params + pa.mtp_layer:,}, {b_name} {pb.total_params + pb.mtp_layer:,}",
    ))  # fmt: skip
    ka, kb = kv_cache_bytes_per_token(a), kv_cache_bytes_per_token(b)
    out.append(Comparison(
        "kv_cache_bytes", "KV cache bytes/token, MLA compressed (bf16)", "bytes", ka.compressed, kb.compressed,
        note="the seed: equal for K2 and V3, so decode attention costs the same",
    ))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- training communication
@dataclass(frozen=True)
class TrainCommBytes:
    """Bytes one rank moves per training step (forward + backward) under FSDP2 x EP.

    All-to-all (expert parallelism, k2_model.expert_parallel): per MoE layer and forward, the
    rank's tokens x K rows go out (dispatch) and come back (combine), and backward sends the
    gradients of both: 4 x T x K rows of D activations per layer, plus 2 more per recomputed
    forward (activation checkpointing). That total is exact whatever the routing, averaged over
    the ranks (a rank sends its own T x K rows and the rows its experts received; the two are
    equal on average, and on each rank when routing is balanced). Of those rows 1/ep stay on the
    rank under balanced routing (`a2a_offrank_bytes` = the rest). The per-expert counts (E int64)
    are exchanged once per MoE layer and forward.

    FSDP2 (ring collectives, (n-1)/n of the gathered size per rank): each decoder layer's
    parameters are all-gathered in forward and again in backward (resharded after forward; the
    root's embeddings, final norm and head once), and each gradient reduce-scattered once in
    fp32. Non-expert parameters over all `world` ranks; under EP the routed experts over
    world / ep ranks, each gathering only its E / ep experts.
    """

    world: int
    ep: int
    tokens_per_rank: int
    a2a_bytes: int
    a2a_offrank_bytes: int
    a2a_count_bytes: int
    fsdp_all_gather_bytes: int
    fsdp_reduce_scatter_bytes: int

    @property
    def a2a_bytes_per_token(self) -> float:
        return self.a2a_bytes / max(self.tokens_per_rank, 1)

    @property
    def total_bytes(self) -> int:
        return (
            self.a2a_bytes
            + self.a2a_count_bytes
            + self.fsdp_all_gather_bytes
            + self.fsdp_reduce_scatter_bytes
        )


def train_comm_bytes(
    cfg: K2Config,
    tokens_per_rank: int,
    world: int,
    ep: int = 1,
    act_bytes: int = 4,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    recomputed_moe_layers: int = 0,
) -> TrainCommBytes:
    """The communication model of one training step on one rank (see TrainCommBytes).

    `act_bytes` / `param_bytes`: the compute dtype's size (2 for bf16 mixed precision);
    `grad_bytes`: the reduce dtype's (4: fp32 reduce-scatter); `recomputed_moe_layers`: MoE
    layers whose forward runs again in backward (activation checkpointing)."""
    if ep < 1 or world % ep:
        raise ValueError(f"ep={ep} must divide world={world}")
    b = param_breakdown(cfg)
    n_moe = num_moe_layers(cfg)
    D, K, E = cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts
    forwards = n_moe + recomputed_moe_layers
    if ep > 1:
        rows = tokens_per_rank * K * (2 * forwards + 2 * n_moe)
        a2a = rows * D * act_bytes
        offrank = a2a * (ep - 1) // ep
        counts = forwards * E * 8
    else:
        a2a = offrank = counts = 0

    def ring(n: int) -> float:
        return (n - 1) / n if n > 1 else 0.0

    routed = b.routed_experts.total
    root = b.embeddings.total + b.lm_head.total + cfg.hidden_size  # final norm
    layered = b.total_params - routed - root
    gather = (2 * layered + root) * ring(world) * param_bytes
    scatter = (layered + root) * ring(world) * grad_bytes
    if ep > 1:  # each rank holds E / ep experts, sharded over the world / ep ranks of dp_shard_mod_ep
        gather += 2 * routed / ep * ring(world // ep) * param_bytes
        scatter += routed / ep * ring(world // ep) * grad_bytes
    else:
        gather += 2 * routed * ring(world) * param_bytes
        scatter += routed * ring(world) * grad_bytes
    return TrainCommBytes(
        world=world,
        ep=ep,
        tokens_per_rank=tokens_per_rank,
        a2a_bytes=int(a2a),
        a2a_offrank_bytes=int(offrank),
        a2a_count_bytes=int(counts),
        fsdp_all_gather_bytes=int(gather),
        fsdp_reduce_scatter_bytes=int(scatter),
    )
