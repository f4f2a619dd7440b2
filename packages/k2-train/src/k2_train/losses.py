"""Losses the Trainer's step takes: a callable giving a micro-batch's loss SUM, and its weight.

The step normalises once for the whole step: loss = sum over micro-batches and ranks of the sums,
divided by the sum of the weights. So a step's loss and gradient do not depend on how the batch
is split into micro-batches or ranks, even when micro-batches carry different numbers of trained
tokens (SFT with loss masks, packed documents): each token counts once, not each micro-batch.
The weight of a micro-batch must be known before its forward (the count of trained tokens for
cross-entropy, the number of prompts for a per-prompt RL objective).

Batches follow the label convention of k2-data and k2-model: `shift_labels[t]` is the target of
position t (-100 = not trained); the other keys are the model's forward arguments.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100
TARGET_KEYS = ("shift_labels",)


class Loss(Protocol):
    """What `Trainer.train_step` needs from a loss.

    Several terms: `weight` and `__call__` return dicts keyed by term name (e.g. {"rl": ...,
    "ptx": ...}); each term is normalised by its own weight over the whole step, and the terms
    are added with the loss's optional `coefficients` dict (default 1 each)."""

    def weight(self, batch: dict[str, Tensor]) -> float:
        """How many items (tokens, prompts...) this micro-batch adds to the step's normaliser."""
        ...

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """The micro-batch's loss summed over its items (a scalar with grad)."""
        ...


def model_inputs(batch: dict[str, Tensor]) -> dict[str, Any]:
    """The batch without its targets: the model's forward arguments."""
    return {k: v for k, v in batch.items() if k not in TARGET_KEYS}


class NextTokenLoss:
    """Cross-entropy of `shift_labels`, summed over the trained tokens (-100 ignored).

    Pretraining: every token of the packed stream is a label. SFT: the same loss; the data's
    loss mask has already turned the labels of untrained tokens (system, user, tool results) into
    -100, so this is the masked cross-entropy. A model whose forward takes `logits_mask` (as
    K2ForCausalLM does) applies its head only at the trained positions; any other model's full
    logits are selected there."""

    name = "next_token"

    def weight(self, batch: dict[str, Tensor]) -> float:
        return float((batch["shift_labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        # The head only where a token is trained (SFT: ~5% of positions): same loss, less compute.
        # A model without `logits_mask` (any nn.Module returning .logits) gives [B, S, N]: select.
        trained_BS = batch["shift_labels"] != IGNORE_INDEX
        inputs = model_inputs(batch)
        if takes_logits_mask(model):
            inputs["logits_mask"] = trained_BS
        logits = model(**inputs).logits
        logits_KN = logits[trained_BS] if logits.dim() == 3 else logits
        return F.cross_entropy(logits_KN.float(), batch["shift_labels"][trained_BS], reduction="sum")


def takes_logits_mask(model: nn.Module) -> bool:
    """Whether `model`'s forward names a `logits_mask` parameter (K2ForCausalLM does): then it can
    apply its head only at the positions a loss reads."""
    return _forward_takes_logits_mask(type(model))


@functools.cache
def _forward_takes_logits_mask(model_type: type) -> bool:
    try:
        return "logits_mask" in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def mean_loss(loss: Loss, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The per-item mean of `loss` on one batch (what `model(**batch).loss` gives for cross-entropy)."""
    return loss(model, batch) / max(loss.weight(batch), 1.0)


def check_batch(batch: dict[str, Tensor]) -> None:
    """Refuse a batch in the other label convention before it trains on shifted-twice targets."""
    if "labels" in batch:
        raise ValueError(
            "batch has a 'labels' key: k2's loaders yield 'shift_labels' (already the next tokens); "
            "rename it, or shift it yourself, so the targets are not shifted twice"
        )
    if not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ValueError("batch has no 'input_ids' tensor")


__all__ = [
    "IGNORE_INDEX",
    "Loss",
    "NextTokenLoss",
    "check_batch",
    "mean_loss",
    "model_inputs",
    "takes_logits_mask",
]
