"""The RL run's picture: reward, held-out accuracy, response length and where the time goes."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: files only
import matplotlib.pyplot as plt


def plot_rl(rows: list[dict], out_dir: Path, label: str = "") -> list[Path]:
    """`rl.png`: four panels from metrics.jsonl rows (iteration rows and evaluation rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    its = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if r.get("heldout_accuracy") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    x = [r["iteration"] for r in its]

    ax = axes[0][0]
    ax.plot(x, [r["reward_mean"] for r in its], label="mean reward (with truncation penalty)")
    ax.plot(x, [r["solve_rate"] for r in its], label="solve rate (reward 1)", alpha=0.7)
    ax.set_title("rollout reward")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ax.plot([r["iteration"] for r in evals], [r["heldout_accuracy"] for r in evals], "o-")
    ax.set_ylim(0, 1)
    ax.set_title("held-out accuracy (greedy)")

    ax = axes[1][0]
    ax.plot(x, [r["response_tokens_mean"] for r in its], label="mean response tokens")
    ax2 = ax.twinx()
    ax2.plot(x, [r["truncation_rate"] for r in its], color="C3", alpha=0.6, label="truncation rate")
    ax2.set_ylim(0, 1)
    ax.set_title("response length / truncation")
    ax.legend(fontsize=8, loc="upper left")
    ax2.legend(fontsize=8, loc="upper right")

    ax = axes[1][1]
    bottom = [0.0] * len(its)
    for key in ("rollout_s", "reward_s", "train_s", "sync_s"):
        vals = [r.get(key, 0.0) for r in its]
        ax.bar(x, vals, bottom=bottom, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("seconds per iteration")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("iteration")
        a.grid(alpha=0.3)
    if label:
        fig.suptitle(label)
    fig.tight_layout()
    path = out_dir / "rl.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


__all__ = ["plot_rl"]
