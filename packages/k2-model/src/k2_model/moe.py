"""Fine-grained MoE: sigmoid router with aux-loss-free balancing, stacked experts, one shared expert.

Shape legend: T tokens (batch * sequence), D hidden size, E routed experts, K experts per token,
I expert intermediate size, N = T * K permuted rows.

Routed experts are stored as three stacked parameters (`gate_proj [E, I, D]`, `up_proj [E, I, D]`,
`down_proj [E, D, I]`, each expert's slice in nn.Linear's [out, in] layout) and run over tokens
grouped by expert by k2-kernels' fused SwiGLU grouped GEMM (`moe_swiglu_experts`: compiled for fp32
CPU, `torch._grouped_mm` otherwise): no per-expert Python loop. Each stacked tensor is
one logical matrix per expert, the unit Muon orthogonalises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The kernels as torch ops (each runs the compiled kernel where one serves, else the reference);
# the fused expert MLP is k2-kernels' grouped GEMM (compiled for fp32 CPU, torch._grouped_mm otherwise).
from k2_kernels import ops as _kops
from torch import Tensor, nn

from k2_model.config import K2Config


class MLP(nn.Module):
    """SwiGLU MLP (dense layers and the shared expert), HF names gate_proj/up_proj/down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Router logits (fp32) and the aux-loss-free selection bias.

    `e_score_correction_bias` only changes which experts are chosen, never the weights. It and
    the per-expert token counts `expert_load` are fp32 buffers that stay fp32 when the model is
    cast to bf16 (a bf16 bias could not move by 1e-3 steps).
    """

    def __init__(self, config: K2Config) -> None:
        super().__init__()
        E = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        # Tokens routed to each expert by training-mode forwards since the last bias update.
        self.register_buffer("expert_load", torch.zeros(E, dtype=torch.float32), persistent=False)
        # Routing against a recorded one (forward(routed_experts=...)): [tokens whose top-k set differs from the
        # record, tokens with a record] over the forwards since the last reset
        self.register_buffer("route_mismatch", torch.zeros(2, dtype=torch.float32), persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        out = super()._apply(fn, recurse)
        for name in ("e_score_correction_bias", "expert_load", "route_mismatch"):
            buf = getattr(self, name)
            if buf.dtype != torch.float32:
                setattr(self, name, buf.float())
        return out

    def forward(self, x_TD: Tensor) -> Tensor:
        return F.linear(x_TD.float(), self.weight.float())


class RoutedExperts(nn.Module):
    """E SwiGLU experts as stacked weights, applied with grouped GEMMs."""

    def __init__(self, config: K2Config) -> None:
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = E
        self.gate_proj = nn.Parameter(torch.empty(E, I, D))
        self.up_proj = nn.Parameter(torch.empty(E, I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        # False: always the torch._grouped_mm composition (for comparisons; same results to fp32
        # rounding). Default: the k2-kernels expert kernel when it runs on OpenBLAS (k2-kernels[blas]).
        self.use_k2_kernel = _kops.preferred("moe_swiglu_experts", "cpu")
        # INT4 quantisation-aware training: > 0 runs the forward on the weights an INT4 export
        # (groups of this many inputs) would load, with straight-through gradients (k2_model.int4)
        self.qat_group_size = 0
        self.qat_bits = 4  # 3 or 2: a coarser fake quantisation (k2_model.int4.fake_quantize_int)

    def forward(self, x_ND: Tensor, offsets_E: Tensor) -> Tensor:
        # Under expert parallelism (k2_model.expert_parallel) the weights are DTensors sharded by
        # expert and the rows/offsets are those of this rank's experts: compute on the local part.
        gate, up, down = (_local(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        if self.qat_group_size:
            from k2_model.int4 import fake_quantize_int

            gate, up, down = (
                fake_quantize_int(w, self.qat_bits, self.qat_group_size) for w in (gate, up, down)
            )
        if self.use_k2_kernel:
            # fp32 CPU: one kernel per direction runs each expert's three GEMMs and the activation
            # while its rows are in cache (experts in parallel); elsewhere the composition below.
            return _kops.moe_swiglu_experts(x_ND, gate, up, down, offsets_E)
        # Separate gate and up GEMMs: concatenating the weights on the fly would copy all experts'
        # weights (and their gradients) every step, which costs more on CPU than the extra launch.
        gate_NI = torch._grouped_mm(x_ND, gate.transpose(-1, -2), offs=offsets_E)
        up_NI = torch._grouped_mm(x_ND, up.transpose(-1, -2), offs=offsets_E)
        return torch._grouped_mm(F.silu(gate_NI) * up_NI, down.transpose(-1, -2), offs=offsets_E)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MoE(nn.Module):
    """K2 / DeepSeek-V3 MoE layer: shared expert + top-k of E routed experts (HF name layout)."""

    def __init__(self, config: K2Config) -> None:
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = RoutedExperts(config)
        self.shared_experts = (
            MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts > 0
            else None
        )
        # set_routing_replay: route by the experts recorded for the tokens, where a forward gets them
        self.replay_routing = False

    def forward(
        self, x_BSD: Tensor, recorded_TK: Tensor | None = None, return_routes: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """`recorded_TK`: the experts another engine chose for these tokens (int, -1 where it has no
        record): the mismatch with this layer's own choice is counted, and with `replay_routing`
        the recorded experts are used. `return_routes`: also return the experts used, [T, K]."""
        cfg = self.config
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits_TE = self.gate(x_TD)
        idx_TK, weight_TK = _kops.moe_route(
            logits_TE,
            self.gate.e_score_correction_bias,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            float(cfg.routed_scaling_factor),
            cfg.norm_topk_prob,
        )
        if recorded_TK is not None:
            idx_TK, weight_TK = self._against_record(logits_TE, idx_TK, weight_TK, recorded_TK)
        x_ND, row_to_slot_N, counts_E, offsets_E = _kops.moe_permute(x_TD, idx_TK, cfg.n_routed_experts)
        if self.training:
            self.gate.expert_load += counts_E.to(torch.float32)
        y_ND = self.experts(x_ND, offsets_E)
        out_TD = _kops.moe_unpermute(y_ND, row_to_slot_N, weight_TK)
        out_BSD = out_TD.view_as(x_BSD)
        if self.shared_experts is not None:
            out_BSD = out_BSD + self.shared_experts(x_BSD)
        return (out_BSD, idx_TK) if return_routes else out_BSD

    def _against_record(
        self, logits_TE: Tensor, idx_TK: Tensor, weight_TK: Tensor, recorded_TK: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Count where this layer's top-k set differs from the record; with `replay_routing`, take
        the recorded experts, weighted as the router weights any choice (the unbiased sigmoid scores
        of the chosen experts, normalised, scaled), so gradients reach the gate as usual."""
        cfg = self.config
        rec_TK = recorded_TK.reshape(idx_TK.shape).to(device=idx_TK.device, dtype=torch.long)
        has_T = (rec_TK >= 0).all(dim=-1)
        differs_T = (idx_TK.sort(dim=-1).values != rec_TK.sort(dim=-1).values).any(dim=-1) & has_T
        self.gate.route_mismatch += torch.stack([differs_T.sum(), has_T.sum()]).to(torch.float32)
        if not self.replay_routing:
            return idx_TK, weight_TK
        idx_TK = torch.where(has_T.unsqueeze(-1), rec_TK, idx_TK)
        w_TK = logits_TE.float().sigmoid().gather(1, idx_TK)
        if cfg.norm_topk_prob:
            w_TK = w_TK / (w_TK.sum(dim=-1, keepdim=True) + 1e-20)
        w_TK = w_TK * float(cfg.routed_scaling_factor)
        return idx_TK, torch.where(has_T.unsqueeze(-1), w_TK.to(weight_TK.dtype), weight_TK)
