"""RL objectives: Kimi K1.5's (the one K2 uses), a GRPO-style clipped objective to compare with,
and the PTX auxiliary term, as functions and as k2-train losses.

Legend: N responses, G prompts (groups), B sequences in a batch, S sequence length.

**K1.5** (Kimi K1.5 report, eq. 3; K2 report section 3.2): for a prompt x with K responses y_i
sampled from pi_old, rewards r_i and their mean r_bar,

    L(x) = (1/K) sum_i ( r_i - r_bar - tau * log(pi_theta(y_i|x) / pi_old(y_i|x)) )^2

and the objective is the mean of L over prompts. Normalisation choices, each deliberate:
* `log pi(y|x)` is the response's SUMMED token log-probability (prompt and padding masked), as
  in the formula: a sequence-level ratio, not a per-token mean. Longer responses therefore move
  further per update; budget control (a maximum length, truncation penalty) bounds that.
* r_bar is the plain mean over the prompt's K responses, including y_i itself (no leave-one-out),
  as written in the report.
* Prompts are weighted equally whatever their K (mean over i inside a prompt, then over prompts).
* Rewards are not divided by their standard deviation (GRPO does; K1.5 does not): tau sets the
  scale of the update relative to the reward.
At theta = pi_old the log-ratio is 0 and the gradient is -2 tau (1/K) sum_i (r_i - r_bar) grad
log pi(y_i|x): a policy gradient with the group mean as baseline; the squared form keeps the
policy close to pi_old as it moves (a mirror-descent step, the K1.5 report's derivation).

**GRPO-style clipped** (for comparison): advantages A_i = (r_i - r_bar) / (std_i + eps) per
group; per token t of response i, ratio = exp(logp_t - logp_old_t), objective
min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i), averaged over all response tokens of the
batch (token-level mean, as DAPO and TRL's default "dapo"/"bnpo" losses; stated, not hidden), no
KL term (beta = 0).

**PTX**: next-token cross-entropy on a curated set, added with a coefficient: a second term of
the same k2-train loss, normalised by its own token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from k2_train.losses import takes_logits_mask
from torch import Tensor, nn

from k2_rl.shared_prompt import packable, shared_prompt_token_logprobs

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- groups


def _groups(group_ids: Tensor) -> tuple[Tensor, Tensor, int]:
    """(group index per response [N] in 0..G-1, responses per group [G], G)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse)
    return inverse, counts, int(counts.numel())


def group_mean(values: Tensor, group_ids: Tensor) -> Tensor:
    """Each response's group mean of `values` ([N] -> [N])."""
    inverse, counts, G = _groups(group_ids)
    sums = torch.zeros(G, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    return (sums / counts.to(values.dtype))[inverse]


# ----------------------------------------------------------------------------- K1.5


def kimi_k15_group_losses(
    logp: Tensor, logp_old: Tensor, rewards: Tensor, group_ids: Tensor, tau: float
) -> Tensor:
    """L(x) for every prompt, [G] (groups in sorted group-id order)."""
    if not (logp.shape == logp_old.shape == rewards.shape == group_ids.shape) or logp.dim() != 1:
        raise ValueError(
            "kimi_k15_loss: logp, logp_old, rewards and group_ids must all be [N]; got "
            f"{tuple(logp.shape)}, {tuple(logp_old.shape)}, {tuple(rewards.shape)}, {tuple(group_ids.shape)}"
        )
    if tau <= 0:
        raise ValueError(f"kimi_k15_loss: tau must be > 0, got {tau}")
    rewards = rewards.to(logp.dtype)
    inverse, counts, G = _groups(group_ids)
    r_sum = torch.zeros(G, dtype=logp.dtype, device=logp.device).index_add_(0, inverse, rewards)
    r_bar = (r_sum / counts.to(logp.dtype))[inverse]
    d = rewards - r_bar - tau * (logp - logp_old.to(logp.dtype))
    sq_sum = torch.zeros(G, dtype=logp.dtype, device=logp.device).index_add_(0, inverse, d * d)
    return sq_sum / counts.to(logp.dtype)


def kimi_k15_loss(logp: Tensor, logp_old: Tensor, rewards: Tensor, group_ids: Tensor, tau: float) -> Tensor:
    """The K1.5 objective: the mean over prompts of mean_i (r_i - r_bar - tau (logp_i - logp_old_i))^2.

    `logp`, `logp_old`, `rewards`: [N] (a response's summed token log-probs under the current and
    the sampling policy, its reward); `group_ids`: [N] integers, responses of one prompt share an
    id, in any order. Returns a scalar."""
    return kimi_k15_group_losses(logp, logp_old, rewards, group_ids, tau).mean()


# ----------------------------------------------------------------------------- GRPO-style


def grpo_clipped_loss(
    logp_tok: Tensor,
    logp_old_tok: Tensor,
    mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    clip_eps: float = 0.2,
    scale_by_std: bool = True,
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """(sum over response tokens of the negated clipped surrogate, number of response tokens).

    `logp_tok`, `logp_old_tok`, `mask`: [N, S] (per-token log-probs of the sampled tokens; mask 1
    on response tokens); `rewards`, `group_ids`: [N]. The loss is sum / count (token-level mean)."""
    rewards = rewards.to(logp_tok.dtype)
    adv = rewards - group_mean(rewards, group_ids)
    if scale_by_std:
        var = group_mean(adv * adv, group_ids)
        inverse, counts, _ = _groups(group_ids)
        n = counts[inverse].to(adv.dtype)
        std = torch.sqrt(var * n / (n - 1).clamp_min(1))  # unbiased, as GRPO
        adv = adv / (std + eps)
    ratio = torch.exp(logp_tok - logp_old_tok)
    a = adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    m = mask.to(logp_tok.dtype)
    return -(surrogate * m).sum(), m.sum()


# ----------------------------------------------------------------------------- token log-probs


def token_logprobs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """log pi(shift_labels[t] | tokens <= t) for every position, [B, S] (0 where the label is -100).

    The batch follows k2's label convention: `shift_labels` are the next tokens, -100 outside the
    response. A batch that names its prompts (`prompt_lens`, `group_ids`, as `k2 rl` builds it) is
    run with one prompt pass per group (`k2_rl.shared_prompt`) when it can be."""
    keys = ("input_ids", "position_ids", "document_ids", "attention_mask", "routed_experts")
    inputs = {k: batch[k] for k in keys if k in batch}
    labels = batch["shift_labels"]
    response = labels != IGNORE_INDEX
    if takes_logits_mask(model) and packable(batch):  # one prompt pass for its K responses
        pad = getattr(getattr(model, "config", None), "pad_token_id", None)
        return shared_prompt_token_logprobs(model, batch, pad if pad is not None else 0)
    if takes_logits_mask(model):  # the head and softmax on the response positions only
        logits_KN = model(**inputs, logits_mask=response).logits.float()
        logp_K = torch.log_softmax(logits_KN, dim=-1).gather(-1, labels[response].unsqueeze(-1)).squeeze(-1)
        return torch.zeros(labels.shape, dtype=logp_K.dtype, device=logp_K.device).masked_scatter(
            response, logp_K
        )
    logits = model(**inputs).logits.float()
    safe = labels.clamp_min(0)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return logp * response


def sequence_logprobs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Each sequence's summed response log-probability, [B]."""
    return token_logprobs(model, batch).sum(dim=1)


# ----------------------------------------------------------------------------- k2-train losses


class KimiK15Loss:
    """The K1.5 objective as a k2-train loss.

    A batch holds one row per response: `input_ids` (prompt + response, padded), `shift_labels`
    (the response's next tokens, -100 on prompt and padding), `logp_old` [B], `rewards` [B],
    `group_ids` [B]. The weight is the number of prompts, so the Trainer's step is the mean over
    prompts; micro-batches must hold whole groups (the loop batches them so). With `ptx_coef`, a
    batch may also carry `ptx_input_ids` / `ptx_shift_labels` rows, a second term normalised by its
    own token count and added with that coefficient.

    Without `logp_old` in the batch the step is on-policy (one update per rollout batch): pi_old is
    the policy being trained, so this forward is pi_old's forward and `logp_old` is its own value,
    detached (the ratio is exactly 1), which saves the loop a second forward. Those values are
    appended to `recorded_logp_old` for the loop's KL and mismatch metrics."""

    name = "kimi_k15"

    def __init__(self, tau: float, ptx_coef: float = 0.0) -> None:
        if tau <= 0:
            raise ValueError(f"KimiK15Loss: tau must be > 0, got {tau}")
        self.tau, self.ptx_coef = tau, ptx_coef
        self.coefficients = {"rl": 1.0, "ptx": ptx_coef}
        self.recorded_logp_old: list[Tensor] = []

    def weight(self, batch: dict[str, Tensor]) -> dict[str, float]:
        w = {"rl": float(torch.unique(batch["group_ids"]).numel())}
        if self.ptx_coef and "ptx_input_ids" in batch:
            w["ptx"] = float((batch["ptx_shift_labels"] != IGNORE_INDEX).sum())
        else:
            w["ptx"] = 0.0
        return w

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        logp = sequence_logprobs(model, batch)
        logp_old = batch.get("logp_old")
        if logp_old is None:  # on-policy: this forward is pi_old's
            logp_old = logp.detach()
            self.recorded_logp_old.append(logp_old)
        rl = kimi_k15_group_losses(logp, logp_old, batch["rewards"], batch["group_ids"], self.tau).sum()
        out = {"rl": rl, "ptx": rl.new_zeros(())}
        if self.ptx_coef and "ptx_input_ids" in batch:
            logits = model(input_ids=batch["ptx_input_ids"]).logits.float()
            out["ptx"] = F.cross_entropy(
                logits.flatten(0, 1),
                batch["ptx_shift_labels"].flatten(),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        return out


class GRPOClippedLoss:
    """The GRPO-style clipped objective as a k2-train loss (token-level mean). Takes `logp_old_tok`
    [B, S] (the old policy's per-token log-probs of the sampled tokens) besides the K1.5 batch;
    without it the step is on-policy, as in `KimiK15Loss` (ratio 1, the forward's own values,
    recorded per sequence in `recorded_logp_old`)."""

    name = "grpo_clipped"

    def __init__(self, clip_eps: float = 0.2, scale_by_std: bool = True) -> None:
        self.clip_eps, self.scale_by_std = clip_eps, scale_by_std
        self.recorded_logp_old: list[Tensor] = []

    def weight(self, batch: dict[str, Tensor]) -> float:
        return float((batch["shift_labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logp_tok = token_logprobs(model, batch)
        mask = batch["shift_labels"] != IGNORE_INDEX
        logp_old_tok = batch.get("logp_old_tok")
        if logp_old_tok is None:  # on-policy: this forward is pi_old's
            logp_old_tok = logp_tok.detach()
            self.recorded_logp_old.append(logp_old_tok.sum(dim=1))
        total, _ = grpo_clipped_loss(
            logp_tok,
            logp_old_tok,
            mask,
            batch["rewards"],
            batch["group_ids"],
            self.clip_eps,
            self.scale_by_std,
        )
        return total


__all__ = [
    "GRPOClippedLoss",
    "KimiK15Loss",
    "grpo_clipped_loss",
    "group_mean",
    "kimi_k15_group_losses",
    "kimi_k15_loss",
    "sequence_logprobs",
    "token_logprobs",
]
