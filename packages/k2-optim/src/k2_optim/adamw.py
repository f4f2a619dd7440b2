"""AdamW for the parameters Muon does not take (embeddings, LM head, norms, biases).

Same arithmetic as torch.optim.AdamW's single-tensor path (decoupled weight decay, bias
correction), written out so that one MuonClip optimizer owns every parameter: one
state_dict, one LR scheduler, one step().
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["adamw_group_step"]


@torch.no_grad()
def adamw_group_step(group: dict[str, Any], state: dict[Tensor, dict[str, Any]]) -> None:
    lr, wd = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    eps = group["adamw_eps"]
    for p in group["params"]:
        grad = p.grad
        if grad is None:
            continue
        if grad.is_sparse:
            raise RuntimeError("AdamW (MuonClip) does not support sparse gradients")
        st = state[p]
        if "step" not in st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] += 1
        step = float(st["step"])
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        p.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
