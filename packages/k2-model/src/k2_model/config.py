"""K2Config: the Kimi K2 / DeepSeek-V3 architecture as a dataclass with Hugging Face field names.

`K2Config.from_hf(dict_or_path)` reads a `config.json` of model_type `kimi_k2` or `deepseek_v3`
(both the transformers 4.x `rope_theta` + `rope_scaling` form and the 5.x `rope_parameters` form);
`to_hf()` writes a dict that transformers' `DeepseekV3Config(**d)` accepts; `preset(name)` gives
`"kimi-k2"` (the released Kimi-K2 config), `"deepseek-v3"`, `"tiny"` (trains on a laptop CPU) and
`"tiny-vllm"` (tiny with K2's MLA latent size, which vLLM's CPU MLA backends need).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")

# Keys of a rope dict that describe YaRN; anything else in it is kept but not interpreted.
_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


@dataclass
class K2Config:
    """Model hyper-parameters; field names and meanings follow HF's DeepseekV3Config."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    n_shared_experts: int = 1
    n_routed_experts: int = 16
    routed_scaling_factor: float = 2.827
    kv_lora_rank: int = 128
    q_lora_rank: int | None = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 4
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    attention_dropout: float = 0.0
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    initializer_range: float = 0.02
    bos_token_id: int | None = 7936
    eos_token_id: int | None = 7937
    pad_token_id: int | None = 8191
    model_type: str = "kimi_k2"
    # Unknown keys from a config.json (quantization_config, auto_map, ...), kept so to_hf round-trips.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.rope_scaling is not None:
            self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)
        self.validate()

    # ------------------------------------------------------------------ derived quantities
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        """Factor the YaRN softmax scale is multiplied by (mscale_all_dim term, squared), 1.0 without YaRN."""
        rs = self.rope_scaling
        if not rs or rs.get("type") != "yarn":
            return 1.0
        m = rs.get("mscale_all_dim") or 0.0
        factor = float(rs["factor"])
        if not m or factor <= 1:
            return 1.0
        g = 0.1 * m * math.log(factor) + 1.0
        return g * g

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale: 1/sqrt(qk_head_dim), times YaRN's mscale^2 (as DeepSeek and transformers do)."""
        return self.qk_head_dim**-0.5 * self.yarn_mscale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field when the config is inconsistent."""
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "n_routed_experts", "kv_lora_rank",
            "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
            "num_experts_per_tok", "max_position_embeddings", "moe_layer_freq",
        )  # fmt: skip
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"K2Config.{name} must be a positive int, got {v!r}")
        for name in ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"K2Config.{name} must be a non-negative int, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(f"K2Config.q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"K2Config.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                "K2Config.num_key_value_heads must equal num_attention_heads for MLA "
                f"(got {self.num_key_value_heads} vs {self.num_attention_heads})"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"K2Config.n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"K2Config.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"K2Config.num_experts_per_tok ({self.num_experts_per_tok}) must be <= "
                f"n_routed_experts ({self.n_routed_experts})"
            )
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                "K2Config.n_group: each expert group needs at least 2 experts (top-2 group score)"
            )
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ValueError(
                f"K2Config.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts in "
                f"topk_group={self.topk_group} groups"
            )
        if self.scoring_func != "sigmoid":
            raise ValueError(f"K2Config.scoring_func must be 'sigmoid', got {self.scoring_func!r}")
        if self.topk_method != "noaux_tc":
            raise ValueError(f"K2Config.topk_method must be 'noaux_tc', got {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"K2Config.hidden_act must be 'silu', got {self.hidden_act!r}")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and self.routed_scaling_factor > 0):
            raise ValueError(
                f"K2Config.routed_scaling_factor must be > 0, got {self.routed_scaling_factor!r}"
            )
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"K2Config.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"K2Config.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.tie_word_embeddings:
            raise ValueError(
                "K2Config.tie_word_embeddings must be False (K2 and DeepSeek-V3 use an untied head)"
            )
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"K2Config.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {self.model_type!r}"
            )

    # ------------------------------------------------------------------ HF interop
    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike) -> K2Config:
        """Build from an HF config dict, a config.json path, or a directory holding config.json."""
        source = "<dict>"
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            try:
                with open(path) as f:
                    config = json.load(f)
            except FileNotFoundError:
                raise FileNotFoundError(f"K2Config.from_hf: no config file at {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"K2Config.from_hf: {path} is not valid JSON: {e}") from None
        d = copy.deepcopy(dict(config))
        mt = d.get("model_type", "deepseek_v3")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"K2Config.from_hf({source}): model_type must be one of {SUPPORTED_MODEL_TYPES}, got {mt!r}"
            )
        d["model_type"] = mt
        # 5.x: rope_parameters holds rope_theta and the scaling; 4.x: rope_theta + rope_scaling.
        rp = d.pop("rope_parameters", None)
        if rp is not None:
            if not isinstance(rp, dict):
                raise ValueError(f"K2Config.from_hf({source}): rope_parameters must be a dict, got {rp!r}")
            rp = dict(rp)
            if "rope_theta" in rp:
                d["rope_theta"] = rp.pop("rope_theta")
            kind = rp.get("rope_type", rp.get("type", "default"))
            d["rope_scaling"] = None if kind == "default" else rp
        # transformers 5.x aliases
        if "num_mtp_layers" in d:
            d.setdefault("num_nextn_predict_layers", d.pop("num_mtp_layers"))
        if "num_local_experts" in d:
            d.setdefault("n_routed_experts", d.pop("num_local_experts"))
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: d.pop(k) for k in list(d) if k in names}
        if kwargs.get("n_group") is None:
            kwargs["n_group"] = 1
        if kwargs.get("topk_group") is None:
            kwargs["topk_group"] = 1
        extra = d.pop("extra", {})
        extra.update(d)
        try:
            return cls(**kwargs, extra=extra)
        except ValueError as e:
            raise ValueError(f"K2Config.from_hf({source}): {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers' DeepseekV3Config (4.x and 5.x) loads.

        model_type is written as `deepseek_v3` so stock transformers loads it without remote code;
        the K2-specific facts are all in the standard fields (n_group=1, routed_scaling_factor...).
        """
        d: dict[str, Any] = {
            k: v for k, v in self.extra.items() if k not in ("auto_map", "quantization_config")
        }
        for f in dataclasses.fields(self):
            if f.name != "extra":
                d[f.name] = copy.deepcopy(getattr(self, f.name))
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        d["num_mtp_layers"] = self.num_nextn_predict_layers
        rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rs = {k: v for k, v in self.rope_scaling.items() if k != "type"}
            rope_parameters = {"rope_type": self.rope_scaling["type"], "rope_theta": self.rope_theta, **rs}
            # 4.x form too ("type" and "rope_type"), so older readers find it
            d["rope_scaling"] = {
                "type": self.rope_scaling["type"],
                "rope_type": self.rope_scaling["type"],
                **rs,
            }
        d["rope_parameters"] = rope_parameters
        return d

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> K2Config:
        """`kimi-k2`, `deepseek-v3`, `tiny` or `tiny-vllm`, optionally with field overrides."""
        if name not in PRESETS:
            raise ValueError(f"K2Config.preset: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        kwargs = copy.deepcopy(PRESETS[name])
        kwargs.update(overrides)
        if "num_attention_heads" in overrides and "num_key_value_heads" not in overrides:
            kwargs["num_key_value_heads"] = overrides["num_attention_heads"]
        return cls(**kwargs)

    def replace(self, **changes: Any) -> K2Config:
        return dataclasses.replace(self, **changes)


def _normalise_rope_scaling(rs: dict[str, Any]) -> dict[str, Any] | None:
    """Accept {type|rope_type: yarn, ...}; return {'type': 'yarn', ...} (None for 'default')."""
    if not isinstance(rs, dict):
        raise ValueError(f"K2Config.rope_scaling must be a dict or None, got {rs!r}")
    rs = dict(rs)
    kind = rs.pop("rope_type", None) or rs.pop("type", None) or "default"
    rs.pop("type", None)
    rs.pop("rope_theta", None)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"K2Config.rope_scaling.type must be 'yarn' (or absent), got {kind!r}")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in rs:
            raise ValueError(f"K2Config.rope_scaling: YaRN needs '{key}'")
    if not float(rs["factor"]) >= 1.0:
        raise ValueError(f"K2Config.rope_scaling.factor must be >= 1, got {rs['factor']!r}")
    return {"type": "yarn", **rs}


# The released Kimi-K2-Instruct config.json (model_type kimi_k2, DeepseekV3ForCausalLM architecture).
_KIMI_K2: dict[str, Any] = dict(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_shared_experts=1,
    n_routed_experts=384,
    routed_scaling_factor=2.827,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    attention_bias=False,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
    initializer_range=0.02,
    bos_token_id=163584,
    eos_token_id=163585,
    pad_token_id=163839,
    model_type="kimi_k2",
)

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json).
_DEEPSEEK_V3: dict[str, Any] = dict(
    _KIMI_K2,
    vocab_size=129280,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    max_position_embeddings=163840,
    rope_theta=10000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
    model_type="deepseek_v3",
)

# Trains visibly on 2 CPU cores in fp32; K2's head dims (128 nope + 64 rope, v 128) and routing,
# vocabulary of the k2-data tokenizer (7936 BPE + 256 specials at K2's offsets).
_TINY: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=16,
    routed_scaling_factor=2.827,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=4,
    first_k_dense_replace=1,
    max_position_embeddings=4096,
    rope_theta=50000.0,
    rope_scaling=None,
    num_nextn_predict_layers=0,
    bos_token_id=7936,
    eos_token_id=7937,
    pad_token_id=8191,
    model_type="kimi_k2",
)

# The tiny preset with K2's real MLA latent (kv_lora_rank 512: MLA head 512 + 64 = 576), the only
# size vLLM's CPU MLA backends accept; `tiny` keeps 128 (results and demos depend on it).
_TINY_VLLM: dict[str, Any] = dict(_TINY, kv_lora_rank=512)

PRESETS: dict[str, dict[str, Any]] = {
    "kimi-k2": _KIMI_K2,
    "deepseek-v3": _DEEPSEEK_V3,
    "tiny": _TINY,
    "tiny-vllm": _TINY_VLLM,
}
