"""Did the run improve? Reward and held-out accuracy from the start to the end of a run, each with
the standard error of its change, so that a console summary can say whether the change is larger
than noise (two standard errors) instead of printing two numbers and leaving the reader to guess.

- Held-out accuracy: greedy accuracy on the same n prompts before training (iteration 0) and at the
  last evaluation; the standard error of the difference treats the two as independent binomials
  (sqrt(p0 (1-p0) / n + p1 (1-p1) / n)), which overstates it for the same prompts: conservative.
- Reward: the mean of the first and the last third of the iterations' mean rewards; the standard
  error from the spread of those iteration means (Welch), which includes the prompt draws'
  variation (16 prompts of very different difficulty per iteration: the iteration mean moves by
  about 0.09 from one draw to the next, so a rise of 0.05 needs tens of iterations to show).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

__all__ = ["Change", "heldout_change", "reward_change"]


@dataclass(frozen=True)
class Change:
    start: float
    end: float
    stderr: float  # of end - start
    what: str  # e.g. "held-out accuracy (400 prompts)"

    @property
    def delta(self) -> float:
        return self.end - self.start

    @property
    def significant(self) -> bool:
        """Up by more than two standard errors."""
        return self.delta > 2 * self.stderr

    def line(self, pct: bool) -> str:
        def f(x: float) -> str:
            return f"{x:.1%}" if pct else f"{x:.3f}"

        unit = " points" if pct else ""
        scale, digits = (100, 1) if pct else (1, 3)
        verdict = (
            "up by more than two standard errors"
            if self.significant
            else "within two standard errors (noise)"
        )
        if self.delta < -2 * self.stderr:
            verdict = "DOWN by more than two standard errors"
        return (
            f"{self.what}: {f(self.start)} -> {f(self.end)} ({self.delta * scale:+.{digits}f}{unit}; "
            f"standard error {self.stderr * scale:.{digits}f}{unit}): {verdict}"
        )


def heldout_change(rows: list[dict[str, Any]], n_prompts: int) -> Change | None:
    """Held-out accuracy at iteration 0 against the last evaluation, or None without both."""
    evals = [r for r in rows if r.get("heldout_accuracy") is not None]
    start = next((r for r in evals if r.get("iteration") == 0), None)
    if start is None or len(evals) < 2 or n_prompts <= 0:
        return None
    p0, p1 = start["heldout_accuracy"], evals[-1]["heldout_accuracy"]
    se = math.sqrt(p0 * (1 - p0) / n_prompts + p1 * (1 - p1) / n_prompts)
    return Change(p0, p1, se, f"held-out accuracy ({n_prompts} prompts, greedy)")


def reward_change(rows: list[dict[str, Any]], window: int | None = None) -> Change | None:
    """Mean reward of the first `window` iterations against the last `window` (default: a third of
    the iterations, at least 3), or None with fewer than two windows of iterations."""
    means = [r["reward_mean"] for r in rows if "reward_mean" in r]
    k = window or max(3, len(means) // 3)
    if len(means) < 2 * k:
        return None
    first, last = means[:k], means[-k:]
    se = math.sqrt(statistics.variance(first) / k + statistics.variance(last) / k)
    return Change(
        statistics.mean(first), statistics.mean(last), se, f"mean reward (first {k} vs last {k} iterations)"
    )
