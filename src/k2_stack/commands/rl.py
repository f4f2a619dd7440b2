"""`k2 rl`: RL with the K1.5 objective (flags and rendering; the loop is k2_rl.run_rl)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from k2_stack.config_flags import add_config_flags, apply_overrides, config_overrides

RESUME_MAY_CHANGE = {
    "threads",
    "rollout_threads",
    "rollout_port",
    "stop_at",
    "device",
    "reward_workers",
    "critic_url",
}


def register(sub: argparse._SubParsersAction) -> None:
    from k2_rl.config import RLConfig

    p = sub.add_parser(
        "rl",
        help="RL with the Kimi K1.5 objective on verifiable tasks (rollouts synced through k2-ckpt)",
        description="Each iteration: sample K responses per prompt with k2-model's engine in a rollout worker, "
        "score them (math-verify in worker processes), take optimizer steps on the K1.5 objective (MuonClip), "
        "push the weights into the worker through k2-ckpt. Writes metrics.jsonl, plots/rl.png and the train state.",
    )
    p.add_argument("--config", type=Path, help="JSON or TOML file with RLConfig fields (flags override it)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR exactly")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_config_flags(p, RLConfig)  # one flag per RLConfig field, help from the field
    from k2_rl.config import ROLLOUTS

    # the name vLLM users look for; the same field as --rollout
    rollout = next(a for a in p._actions if a.dest == "rollout")
    p.add_argument(
        "--rollout-engine",
        dest="rollout",
        choices=ROLLOUTS,
        default=None,
        help=f"{rollout.help}; the same as --rollout",
    )
    p.set_defaults(func=run)


def _extendable(run_dir: Path) -> set[str]:
    """{"iterations"} when a resume may run the loop past its planned end: the lr is constant and
    prompts and sampling seeds are functions of the iteration, so a run extended from 50 to 100
    iterations is the 100-iteration run; only a temperature decay spans `iterations`."""
    try:
        stored = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return set()
    return {"iterations"} if stored.get("temperature") == stored.get("temperature_end") else set()


def build_config(args: argparse.Namespace):
    from k2_rl.config import RLConfig

    overrides = config_overrides(args, RLConfig)
    if args.resume is not None:
        from k2_stack.commands.training import resumed_config

        return resumed_config(args.resume, RLConfig, overrides, RESUME_MAY_CHANGE | _extendable(args.resume))
    cfg = RLConfig.from_file(args.config) if args.config is not None else RLConfig()
    return apply_overrides(cfg, overrides)


def run(args: argparse.Namespace) -> int:
    from k2_rl.loop import run_rl
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        cfg = build_config(args)
        cfg.validate()
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]k2 rl: {e}[/red]", soft_wrap=True)
        return 2
    for warning in cfg.warnings():
        console.print(f"[yellow]k2 rl: warning: {warning}[/yellow]", soft_wrap=True)
    t_start = time.monotonic()
    first: list[tuple[float, int]] = []  # (time, iteration) of this run's start, for the ETA

    def on_iteration(row: dict) -> None:
        if args.json:
            return
        from k2_train.metrics import eta_seconds, format_duration

        if not first:
            first.append((t_start, row["iteration"] - 1))
        eta = eta_seconds(first[0], time.monotonic(), row["iteration"], cfg.iterations)
        acc = f"  held-out {row['heldout_accuracy']:.1%}" if row.get("heldout_accuracy") is not None else ""
        line = (
            f"rl iteration {row['iteration']}/{cfg.iterations}  reward {row['reward_mean']:.3f}  "
            f"solved {row['solve_rate']:.1%}{acc}  len {row['response_tokens_mean']:.1f}  "
            + (f"kl {row['kl_estimate']:.4f}  " if row.get("kl_estimate") is not None else "")
            + f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s "
            f"sync {row['sync_s']:.2f}s  ({time.monotonic() - t_start:.0f}s"
            + (f", eta {format_duration(eta)})" if eta is not None else ")")
        )
        console.print(line, soft_wrap=True, highlight=False)
        sys.stdout.flush()

    try:
        result = run_rl(
            cfg,
            resume=args.resume is not None,
            on_iteration=on_iteration,
            log=(lambda _m: None) if args.json else (lambda m: console.print(m, soft_wrap=True)),
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        console.print(f"[red]k2 rl: {e}[/red]", soft_wrap=True)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.json:
        print(
            json.dumps(
                {
                    k: str(v) if isinstance(v, Path) else v
                    for k, v in dataclasses.asdict(result).items()
                    if k != "plots"
                }
            )
        )
    else:
        t = Table(title=f"k2 rl: {result.run_dir}")
        for col in ("iterations", "optimizer steps", "reward (first -> last)", "held-out (before -> after)"):
            t.add_column(col, justify="right")

        def change(start, end, fmt) -> str:
            if end is None:
                return "-"
            return format(end, fmt) if start is None else f"{format(start, fmt)} -> {format(end, fmt)}"

        t.add_row(
            f"{result.iterations_done}/{cfg.iterations}",
            str(result.steps),
            change(result.reward_mean_start, result.reward_mean, ".3f"),
            change(result.heldout_accuracy_start, result.heldout_accuracy, ".1%"),
        )
        console.print(t)
        from k2_rl.report import heldout_change, reward_change
        from k2_train.metrics import read_metrics

        rows = read_metrics(result.run_dir / "metrics.jsonl")
        for change, pct in (
            (reward_change(rows), False),
            (heldout_change(rows, result.heldout_prompts), True),
        ):
            if change is not None:
                console.print(change.line(pct), soft_wrap=True, highlight=False)
        state = (
            f"stopped early (resume with `k2 rl --resume {result.run_dir}`)" if result.interrupted else "done"
        )
        console.print(
            f"{state}; run directory: [bold]{result.run_dir}[/bold] (metrics.jsonl, plots/rl.png, state/)"
        )
    return 130 if result.interrupted and not cfg.stop_at else 0
