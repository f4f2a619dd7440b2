"""Plots of a run's metrics.jsonl: the loss curve and the max-logit trace with tau drawn
(the shape of the K2 paper's Figure 2). Several runs can share one figure for comparisons."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt

from k2_train.metrics import read_metrics  # noqa: F401  (plots are drawn from metrics.jsonl rows)


def _ema(values: Sequence[float], decay: float) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else decay * avg + (1 - decay) * v
        out.append(avg)
    return out


def plot_runs(
    runs: Sequence[tuple[str, list[dict]]], out_dir: Path, tau: float | None = None, prefix: str = ""
) -> list[Path]:
    """Write `{prefix}loss.png` and `{prefix}max_logit.png` for one or more labelled runs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs):
        color = colors[i % len(colors)]
        train = [r for r in rows if "loss" in r]
        steps, losses = [r["step"] for r in train], [r["loss"] for r in train]
        # Per-batch losses are noisy (code and docstrings vary a lot): draw them faintly, and an
        # exponential moving average on top; the held-out loss is the clean comparison.
        ax.plot(steps, losses, color=color, lw=0.6, alpha=0.25)
        ax.plot(steps, _ema(losses, 0.9), color=color, lw=1.4, label=f"{label} train (EMA)")
        val = [r for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot(
                [r["step"] for r in val],
                [r["val_loss"] for r in val],
                "o--",
                color=color,
                ms=3,
                lw=1,
                label=f"{label} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{prefix}loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, rows) in enumerate(runs):
        pts = [r for r in rows if r.get("max_logit") is not None]
        ax.plot(
            [r["step"] for r in pts],
            [r["max_logit"] for r in pts],
            label=label,
            lw=1,
            color=colors[i % len(colors)],
        )
    if tau is not None:
        ax.axhline(tau, color="k", ls="--", lw=1, label=f"tau = {tau:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("max attention logit (all heads)")
    ax.set_title("max logit per step, before QK-Clip")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{prefix}max_logit.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written
