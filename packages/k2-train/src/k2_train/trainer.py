"""The Trainer: one optimizer step over a global batch, and the loop around it.

Legend: B = per-rank batch (sequences), M = micro-batch, S = sequence length.

`train_step(batch)`: the batch (this rank's B sequences) is split into micro-batches of M; each
is forwarded and backpropagated with its loss sum scaled by world_size / W, where W is the
step's total loss weight over all micro-batches and ranks (FSDP2 averages gradients over ranks,
so the result is the gradient of sum / W). Then gradient-norm clipping, the optimizer step (for
MuonClip, QK-Clip from the max logits recorded over all micro-batches of the step), the schedule
and the aux-loss-free expert-bias update. The model takes part through duck-typed hooks it may
or may not have (`attention_max_logits`, `reset_attention_max_logits`, `update_expert_bias`), so
any `nn.Module` with a matching loss trains.

`fit(loader, ...)`: steps until `config.steps`, evaluating, saving the train state and calling
the callbacks; Ctrl-C (SIGINT) finishes the current step, saves, and returns `interrupted=True`
(a second Ctrl-C aborts). Under torchrun an interrupt on any rank stops every rank at one step.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from k2_train import distributed as dd
from k2_train.losses import Loss, NextTokenLoss, check_batch
from k2_train.metrics import Callback, StepMetrics
from k2_train.state import TrainState


@dataclass
class TrainerConfig:
    steps: int
    micro_batch: int = 0  # sequences per forward on each rank; 0 = the rank's whole batch
    grad_clip: float = 1.0  # gradient-norm clip; 0 = off
    bias_update_speed: float = 1e-3  # aux-loss-free balancing step per optimizer step
    eval_every: int = 0  # validation every N steps and at the last step; 0 = never
    save_every: int = 0  # train state every N steps; the last (or stopped) step is always saved
    stop_at: int = 0  # stop after this step with a saved state, as an interrupt would; 0 = never
    # After each step, re-run the step's first micro-batch (no grad) and log the max logit the
    # updated (clipped) weights give: `max_logit_after_clip`. Costs about a third of a step.
    log_post_clip_logit: bool = False

    def validate(self) -> None:
        for name, ok, what in (
            ("steps", self.steps > 0, "> 0"),
            ("micro_batch", self.micro_batch >= 0, ">= 0"),
            ("grad_clip", self.grad_clip >= 0, ">= 0"),
            ("eval_every", self.eval_every >= 0, ">= 0"),
            ("save_every", self.save_every >= 0, ">= 0"),
            ("stop_at", self.stop_at >= 0, ">= 0"),
        ):
            if not ok:
                raise ValueError(f"TrainerConfig.{name}={getattr(self, name)!r}: expected {what}")


@dataclass
class FitResult:
    steps_done: int
    interrupted: bool
    last: StepMetrics | None
    history: list[StepMetrics] = field(default_factory=list)


def as_terms(value: Any) -> dict[str, Any]:
    """A loss's value or weight as named terms: a plain one is the single term "loss"."""
    return dict(value) if isinstance(value, dict) else {"loss": value}


def expert_maxvio(load_LE: Tensor) -> float:
    """MaxVio (Wang et al., aux-loss-free balancing): mean over layers of (max load / mean load) - 1."""
    if load_LE.numel() == 0:
        return 0.0
    load = load_LE.float()
    mean = load.mean(dim=-1).clamp_min(1e-9)
    return float((load.max(dim=-1).values / mean - 1.0).mean())


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss: Loss | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        config: TrainerConfig,
        info: dd.DistInfo = dd.SINGLE_PROCESS,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        config.validate()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss: Loss = loss if loss is not None else NextTokenLoss()
        self.config, self.info, self.device = config, info, torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.callbacks = list(callbacks)
        self.step = 0  # optimizer steps taken
        self.tokens = 0  # input tokens seen, all ranks
        self._interrupted = False

    # ------------------------------------------------------------------ state (a TrainState component)
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step, self.tokens = int(state_dict["step"]), int(state_dict["tokens"])

    # ------------------------------------------------------------------ one step
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _micro_batches(self, batch: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        B = batch["input_ids"].shape[0]
        M = self.config.micro_batch or B
        if B % M:
            raise ValueError(f"micro_batch {M} does not divide this rank's batch of {B} sequences")
        return [{k: v[i : i + M] for k, v in batch.items()} for i in range(0, B, M)]

    def train_step(self, batch: dict[str, Tensor], loader_s: float = 0.0) -> StepMetrics:
        """One optimizer step on this rank's part of the global batch (see the module docstring)."""
        check_batch(batch)
        t0 = time.perf_counter()
        model, info = self.model, self.info
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        micro = self._micro_batches(batch)
        # A loss is one term (a sum and its weight) or several named ones, each normalised by its
        # own weight over the whole step, then combined with the loss's coefficients (e.g. RL +
        # a PTX next-token term).
        weights = [as_terms(self.loss.weight(mb)) for mb in micro]
        names = list(weights[0])
        coefs = getattr(self.loss, "coefficients", None) or {}
        totals = {
            n: dd.all_reduce_scalar(sum(w.get(n, 0.0) for w in weights), "sum", info, self.device)
            for n in names
        }
        if all(t <= 0 for t in totals.values()):
            raise ValueError(
                f"step {self.step + 1}: the batch has nothing to train on (loss weight 0 on every "
                "rank: no token of it is a training target). With chat data this means the trained "
                "turns lie past --seq-len: raise --seq-len (the start-up lines say how long the "
                "conversations are)"
            )
        scales = {n: info.world_size * coefs.get(n, 1.0) / totals[n] if totals[n] > 0 else 0.0 for n in names}
        sums = dict.fromkeys(names, 0.0)
        for mb in micro:
            with self.autocast():
                terms = as_terms(self.loss(model, mb))
            sum(terms[n] * scales[n] for n in names).backward()
            for n in names:
                sums[n] += float(terms[n].detach())
        term_loss = {
            n: dd.all_reduce_scalar(sums[n], "sum", info, self.device) / totals[n] if totals[n] > 0 else 0.0
            for n in names
        }
        loss = sum(coefs.get(n, 1.0) * term_loss[n] for n in names)
        total_weight = totals[names[0]]
        max_logit = None
        if hasattr(model, "attention_max_logits"):  # before any clip; MuonClip resets the record
            max_logit = dd.all_reduce_scalar(
                float(model.attention_max_logits().max()), "max", info, self.device
            )
        grad_norm = dd.clip_grad_norm(list(model.parameters()), self.config.grad_clip or math.inf)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        clipped, frac_ever = 0, 0.0
        if getattr(self.optimizer, "tau", None) is not None and hasattr(self.optimizer, "last_clip_stats"):
            stats = self.optimizer.last_clip_stats()
            clipped, frac_ever = int(stats["num_clipped"]), float(stats["fraction_ever_clipped"])
        elif hasattr(model, "reset_attention_max_logits"):
            model.reset_attention_max_logits()
        load_LE = torch.zeros(0)
        if hasattr(model, "update_expert_bias"):
            load_LE = model.update_expert_bias(self.config.bias_update_speed)
        after_clip = self._post_clip_max_logit(micro[0]) if self.config.log_post_clip_logit else None
        self.step += 1
        step_tokens = batch["input_ids"].numel() * info.world_size
        self.tokens += step_tokens
        dt = time.perf_counter() - t0 + loader_s
        return StepMetrics(
            step=self.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            max_logit=max_logit,
            clipped_heads=clipped,
            fraction_heads_ever_clipped=frac_ever,
            expert_maxvio=expert_maxvio(load_LE),
            tokens=self.tokens,
            loss_tokens=total_weight,
            tokens_per_s=step_tokens / dt,
            step_s=dt,
            loader_s=loader_s,
            max_logit_after_clip=after_clip,
            extra={f"loss/{n}": v for n, v in term_loss.items()} if len(names) > 1 else {},
        )

    @torch.no_grad()
    def _post_clip_max_logit(self, batch: dict[str, Tensor]) -> float | None:
        """The max logit the just-updated weights give on this input (a training-mode forward, so
        the model records it), leaving no trace in the max-logit record or the expert loads."""
        model = self.model
        if not hasattr(model, "attention_max_logits"):
            return None
        model.reset_attention_max_logits()
        with self.autocast():
            model(batch["input_ids"])
        value = float(model.attention_max_logits().max())
        model.reset_attention_max_logits()
        for router in getattr(model, "moe_routers", list)():
            router.expert_load.zero_()
        return value

    @torch.no_grad()
    def evaluate(self, batches: Iterable[dict[str, Tensor]]) -> float:
        """The loss over `batches` (weighted like a step: sum / total weight), in eval mode. Every
        rank passes the same batches (each runs the forward; FSDP2 gathers the weights)."""
        was_training = self.model.training
        self.model.eval()
        total: dict[str, float] = {}
        weight: dict[str, float] = {}
        try:
            for batch in batches:
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with self.autocast():
                    for n, v in as_terms(self.loss(self.model, batch)).items():
                        total[n] = total.get(n, 0.0) + float(v)
                for n, w in as_terms(self.loss.weight(batch)).items():
                    weight[n] = weight.get(n, 0.0) + w
        finally:
            self.model.train(was_training)
        coefs = getattr(self.loss, "coefficients", None) or {}
        return sum(coefs.get(n, 1.0) * total[n] / max(weight.get(n, 0.0), 1.0) for n in total)

    # ------------------------------------------------------------------ the loop
    def fit(
        self,
        loader: Iterator[dict[str, Tensor]],
        state: TrainState | None = None,
        eval_batches: Callable[[], Iterable[dict[str, Tensor]]] | None = None,
    ) -> FitResult:
        """Train from `self.step` to `config.steps` (see the module docstring)."""
        cfg, info = self.config, self.info
        self.model.train()
        callbacks = self.callbacks if info.is_main else []
        for cb in callbacks:
            cb.on_fit_start(self)
        self._interrupted = False
        history: list[StepMetrics] = []
        last: StepMetrics | None = None
        with self._sigint_finishes_step():
            while self.step < cfg.steps and not self._interrupted:
                wait0 = getattr(loader, "wait_s", None)
                t0 = time.perf_counter()
                batch = next(loader)
                loader_s = (loader.wait_s - wait0) if wait0 is not None else time.perf_counter() - t0
                metrics = self.train_step(batch, loader_s=loader_s)
                if (
                    eval_batches is not None
                    and cfg.eval_every
                    and (self.step % cfg.eval_every == 0 or self.step == cfg.steps)
                ):
                    metrics.val_loss = self.evaluate(eval_batches())
                for cb in callbacks:
                    cb.on_step_end(self, metrics)
                history.append(metrics)
                last = metrics
                if info.enabled:  # an interrupt on any rank stops every rank at the same step
                    self._interrupted = bool(
                        dd.all_reduce_scalar(float(self._interrupted), "max", info, self.device)
                    )
                stop_here = bool(cfg.stop_at) and self.step == cfg.stop_at
                due = bool(cfg.save_every) and self.step % cfg.save_every == 0
                if state is not None and (due or self.step == cfg.steps or stop_here or self._interrupted):
                    state.save(self.step)  # a collective under FSDP2: every rank takes part
                if stop_here:
                    self._interrupted = True
        result = FitResult(self.step, self.step < cfg.steps, last, history)
        for cb in callbacks:
            cb.on_fit_end(self, result)
        return result

    def _on_interrupt(self) -> None:
        self._interrupted = True
        for cb in self.callbacks if self.info.is_main else []:
            notify = getattr(cb, "on_interrupt", None)
            if notify is not None:
                notify(self)

    def _sigint_finishes_step(self):
        return finish_then_stop_on_sigint(self._on_interrupt, lambda: self._interrupted)


@contextlib.contextmanager
def finish_then_stop_on_sigint(on_first: Callable[[], None], already: Callable[[], bool]):
    """While active (main thread only), the first Ctrl-C calls `on_first()` (the loop then finishes
    its unit of work, saves and stops); a second one, once `already()` says so, aborts with
    KeyboardInterrupt. The previous handler is restored on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        if already():
            raise KeyboardInterrupt
        on_first()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


__all__ = ["FitResult", "Trainer", "TrainerConfig", "expert_maxvio", "finish_then_stop_on_sigint"]
