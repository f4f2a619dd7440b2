"""A step's metrics and the callbacks that receive them.

`Trainer.fit` calls each callback on rank 0 only: `on_fit_start(trainer)` (trainer.step is where
the run starts or resumes), `on_step_end(trainer, metrics)` after every step (validation loss
included on evaluation steps), `on_fit_end(trainer, result)`. `JSONLMetrics` writes the run's
`metrics.jsonl`; the `k2` command adds a rich progress bar; a user can attach a wandb or
tensorboard logger the same way:

    class TensorBoard(Callback):
        def __init__(self, writer): self.w = writer
        def on_step_end(self, trainer, m):
            for k, v in m.row().items():
                if isinstance(v, (int, float)): self.w.add_scalar(k, v, m.step)
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    max_logit: float | None  # the step's max attention logit before QK-Clip (None: the model records none)
    clipped_heads: int
    fraction_heads_ever_clipped: float
    expert_maxvio: float  # MaxVio of the step's expert loads (0 for a dense model)
    tokens: int  # input tokens seen so far (all ranks)
    loss_tokens: float  # items the step's loss averaged over (trained tokens for cross-entropy)
    tokens_per_s: float
    step_s: float
    loader_s: float = 0.0
    max_logit_after_clip: float | None = None
    val_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl line: every field, optional ones only when set, extras flattened."""
        d = asdict(self)
        extra = d.pop("extra")
        for key in ("max_logit_after_clip", "val_loss"):
            if d[key] is None:
                d.pop(key)
        d.update(extra)
        return d


class Callback:
    """Base class: override what you need."""

    def on_fit_start(self, trainer: Any) -> None:
        pass

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        pass

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        pass


class JSONLMetrics(Callback):
    """One JSON object per step in `path`. On a resume, lines after the resumed step are dropped
    first (that work is redone, so each step appears once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._f: IO[str] | None = None

    def on_fit_start(self, trainer: Any) -> None:
        truncate_metrics(self.path, trainer.step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        if self._f is None:
            self.on_fit_start(trainer)
        self.write(metrics.row())

    def write(self, row: dict[str, Any]) -> None:
        """Append any row (a loop's own rows, e.g. RL's per-iteration ones); after on_fit_start."""
        if self._f is None:
            raise RuntimeError("JSONLMetrics.write before on_fit_start (which opens the file)")
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class PlainProgress(Callback):
    """A plain progress line every `every_s` seconds (and at the last step) for logs that are not
    a terminal (CI, `| tee`), where a live progress bar prints nothing until the end."""

    def __init__(
        self, total_steps: int, every_s: float = 10.0, stream: TextIO | None = None, label: str = "train"
    ) -> None:
        self.total, self.every_s, self.label = total_steps, every_s, label
        self.stream = stream or sys.stdout
        self._last = 0.0
        self._start: tuple[float, int] | None = None  # (time, step) of the first step seen

    def on_step_end(self, trainer: Any, metrics: StepMetrics) -> None:
        now = time.monotonic()
        if self._start is None:
            self._start = (now, metrics.step)
        evaluated = metrics.val_loss is not None  # validation lines are never throttled away
        if not evaluated and now - self._last < self.every_s and metrics.step != self.total and self._last:
            return
        self._last = now
        parts = [f"{self.label} step {metrics.step}/{self.total}", f"loss {metrics.loss:.4f}"]
        if metrics.val_loss is not None:
            parts.append(f"val {metrics.val_loss:.4f}")
        if metrics.max_logit is not None:
            parts.append(f"max logit {metrics.max_logit:.1f}")
        parts += [f"clipped {metrics.clipped_heads}", f"{metrics.tokens_per_s:.0f} tok/s"]
        eta = eta_seconds(self._start, now, metrics.step, self.total)
        if eta is not None:
            parts.append(f"eta {format_duration(eta)}")
        print("  ".join(parts), file=self.stream, flush=True)

    def on_interrupt(self, trainer: Any) -> None:
        print(
            f"{self.label}: interrupt: finishing this step, then saving the train state (Ctrl-C again to abort)",
            file=self.stream,
            flush=True,
        )


def eta_seconds(start: tuple[float, int] | None, now: float, step: int, total: int) -> float | None:
    """Seconds left at the pace since `start` (time, step), or None before there is a pace."""
    if start is None or step <= start[1] or step >= total:
        return None
    return (now - start[0]) / (step - start[1]) * (total - step)


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7 -> '7s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def truncate_metrics(path: str | Path, last_step: int) -> None:
    """Keep the lines of steps <= last_step (atomically)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


__all__ = ["Callback", "JSONLMetrics", "PlainProgress", "StepMetrics", "read_metrics", "truncate_metrics"]
