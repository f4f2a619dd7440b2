"""MoE routing replay for RL: the experts the rollout engine routed each token to, laid out as
the trainer's batch, and the per-layer mismatch between those and the trainer's own choices.

An MoE policy samples in the rollout engine and is trained by another forward: a different kernel,
batch shape or dtype, or a router bias updated in between, can send a token to other experts, and
the log-probs the trainer optimises are then those of a different network than the one that sampled
(the engine/trainer mismatch of MoE RL). k2's engine records each token's experts beside its KV rows
(`k2_model.engine.Engine(record_routes=True)`; vLLM's `--enable-return-routed-experts` returns the
same `[tokens - 1, MoE layers, K]` array), the loop lays them out as `routed_experts`
[rows, seq, MoE layers, K] (-1 where nothing was recorded: padding, a sample's last token), and the
model (`K2ForCausalLM.forward(routed_experts=...)`) counts, per MoE layer, the tokens whose top-k
set differs from the record. `--routing-replay` makes the training forward route by the record
(`K2ForCausalLM.set_routing_replay`): the gate's weights still get gradients through the chosen
experts' scores, and the replayed choices are what the aux-loss-free bias counts (they are the
experts that served the tokens).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import torch
from torch import Tensor


def encode_routes(routes: Tensor | None) -> str | None:
    """Routes as base64 `.npy` bytes, the form vLLM returns them in (one decoder for both engines)."""
    if routes is None:
        return None
    import numpy as np

    buf = io.BytesIO()
    np.save(buf, routes.to(torch.int16).cpu().numpy(), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_routes(data: str | None) -> Tensor | None:
    """The inverse of `encode_routes` (also reads vLLM's `routed_experts`): int16 [tokens, layers, K]."""
    if data is None:
        return None
    import numpy as np

    arr = np.load(io.BytesIO(base64.b64decode(data)), allow_pickle=False)
    if arr.ndim != 3:
        raise ValueError(
            f"routed experts: expected [tokens, layers, experts per token], got shape {arr.shape}"
        )
    return torch.from_numpy(arr.astype(np.int16))


def routes_batch(records: Sequence[Tensor | None], length: int) -> Tensor | None:
    """[rows, length, MoE layers, K] int16 from each row's record (position p of the row at [r, p]),
    -1 where a row has none; None when no row has a record (an engine that does not record)."""
    first = next((r for r in records if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(records), length, *first.shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(records):
        if r is not None:
            n = min(length, r.shape[0])
            out[i, :n] = r[:n].to(torch.int16)
    return out


def mismatch_metrics(counts_L2: Tensor) -> dict[str, float]:
    """`routing_mismatch` (all MoE layers) and `routing_mismatch_layer{j}` (the j-th MoE layer): the
    fraction of recorded tokens whose top-k expert set in the training forward differs from the
    rollout engine's. `counts_L2` is `K2ForCausalLM.routing_mismatch()` summed over ranks."""
    counts = counts_L2.double().cpu()
    if counts.numel() == 0 or float(counts[:, 1].sum()) == 0:
        return {}
    row = {"routing_mismatch": float(counts[:, 0].sum() / counts[:, 1].sum())}
    for j, (bad, seen) in enumerate(counts.tolist()):
        row[f"routing_mismatch_layer{j}"] = bad / seen if seen else 0.0
    return row


__all__ = ["decode_routes", "encode_routes", "mismatch_metrics", "routes_batch"]
