"""Small reference models that implement the QK-Clip protocol (used by the tests and the README).

`TinyMLAModel` is a DeepSeek-V3/K2-shaped attention stack in plain PyTorch: it shows, in ~100
lines, what a model has to provide for MuonClip (max logits recorded in training mode, and the
rows of each head in `qk_clip_layers()`).
"""

import math

import torch
from torch import nn

__all__ = ["TinyMLA", "TinyMLAModel", "loud_mla_model"]

# legend: B batch, S/T query/key positions, D hidden, H heads, P nope dim, R rope dim, V value dim, C kv latent


def _rope(x_BHSR: torch.Tensor) -> torch.Tensor:
    S, R = x_BHSR.shape[-2], x_BHSR.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))
    ang_SR2 = torch.arange(S).float()[:, None] * inv[None, :]
    cos, sin = ang_SR2.cos(), ang_SR2.sin()
    x1, x2 = x_BHSR[..., 0::2], x_BHSR[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TinyMLA(nn.Module):
    """DeepSeek-V3/K2-shaped attention: per-head q (nope|rope), a shared rotary key from
    kv_a_proj_with_mqa, per-head k-nope and v from kv_b_proj."""

    def __init__(self, D=32, H=4, P=8, R=4, V=8, C=16):
        super().__init__()
        self.H, self.P, self.R, self.V, self.C = H, P, R, V, C
        self.q_proj = nn.Linear(D, H * (P + R), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, C + R, bias=False)
        self.kv_a_layernorm = nn.RMSNorm(C)
        self.kv_b_proj = nn.Linear(C, H * (P + V), bias=False)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        self.scale = (P + R) ** -0.5
        self.register_buffer("max_logits_H", torch.full((H,), -math.inf))

    def logits_and_v(self, x_BSD):
        B, S, _ = x_BSD.shape
        H, P, R, V, C = self.H, self.P, self.R, self.V, self.C
        q = self.q_proj(x_BSD).view(B, S, H, P + R).transpose(1, 2)
        q_nope, q_rope = q[..., :P], _rope(q[..., P:])
        ckv = self.kv_a_proj_with_mqa(x_BSD)
        k_rope = _rope(ckv[..., C:].unsqueeze(1))  # [B, 1, S, R], shared by every head
        kv = self.kv_b_proj(self.kv_a_layernorm(ckv[..., :C])).view(B, S, H, P + V).transpose(1, 2)
        k_nope, v = kv[..., :P], kv[..., P:]
        logits = (q_nope @ k_nope.transpose(-1, -2) + q_rope @ k_rope.transpose(-1, -2)) * self.scale
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        return logits.masked_fill(~causal, -math.inf), v

    def forward(self, x_BSD):
        logits, v = self.logits_and_v(x_BSD)
        if self.training:
            with torch.no_grad():
                self.max_logits_H.copy_(torch.maximum(self.max_logits_H, logits.amax(dim=(0, 2, 3))))
        out = logits.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).flatten(2))


class TinyMLAModel(nn.Module):
    def __init__(self, vocab=64, D=32, layers=2, H=4):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(TinyMLA(D, H) for _ in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(D) for _ in range(layers))
        self.gate = nn.Linear(D, 8, bias=False)  # a router-shaped matrix, for the routing test
        self.lm_head = nn.Linear(D, vocab, bias=False)

    def forward(self, ids):
        h = self.embed_tokens(ids)
        for norm, attn in zip(self.norms, self.layers):
            h = h + attn(norm(h))
        return self.lm_head(h) + 0 * self.gate(h).sum()

    # -- QK-Clip protocol
    def attention_max_logits(self):
        return torch.stack([a.max_logits_H for a in self.layers])

    def reset_attention_max_logits(self):
        for a in self.layers:
            a.max_logits_H.fill_(-math.inf)

    def qk_clip_layers(self):
        out = []
        for i, a in enumerate(self.layers):
            P, R, V = a.P, a.R, a.V
            out.append(
                {
                    "name": f"layers.{i}",
                    "num_heads": a.H,
                    "spans": [
                        {"param": a.q_proj.weight, "stride": P + R, "start": 0, "length": P, "power": 0.5},
                        {"param": a.q_proj.weight, "stride": P + R, "start": P, "length": R, "power": 1.0},
                        {"param": a.kv_b_proj.weight, "stride": P + V, "start": 0, "length": P, "power": 0.5},
                    ],
                }
            )
        return out


def loud_mla_model(seed: int = 0, gain: float = 12.0) -> "TinyMLAModel":
    """A TinyMLAModel whose q/k weights are scaled up so that max logits run into the tens."""
    torch.manual_seed(seed)
    m = TinyMLAModel()
    with torch.no_grad():  # large q/k weights so that logits run into the tens
        for a in m.layers:
            a.q_proj.weight.mul_(gain)
            a.kv_b_proj.weight.mul_(gain)
    return m
