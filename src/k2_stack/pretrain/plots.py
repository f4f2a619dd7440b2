"""Plots of a run's metrics.jsonl: the loss curve and the max-logit trace with tau drawn
(the shape of the K2 paper's Figure 2). Several runs can share one figure for comparisons."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def plot_runs(
    runs: Sequence[tuple[str, list[dict]]], out_dir: Path, tau: float | None = None, prefix: str = ""
) -> list[Path]:
    """Write `{prefix}loss.png` and `{prefix}max_logit.png` for one or more labelled runs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, rows in runs:
        train = [r for r in rows if "loss" in r]
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{label} train", lw=1)
        val = [r for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", ms=3, label=f"{label} val")
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
    for label, rows in runs:
        pts = [r for r in rows if r.get("max_logit") is not None]
        ax.plot([r["step"] for r in pts], [r["max_logit"] for r in pts], label=label, lw=1)
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
