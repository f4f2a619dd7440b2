"""What `k2 pretrain` and `k2 sft` share: their flags (generated from the config's fields), config
building (with resume rules), the progress display (a rich bar on a terminal, a plain line every
few seconds elsewhere) and the summary. The loop itself is k2_train.run_training."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from k2_stack.config_flags import add_config_flags, apply_overrides, config_overrides, get_flat

# Flags a resumed run may change: they do not change what is computed.
RESUME_MAY_CHANGE = {"threads", "stop_at", "device"}


def add_common_flags(p: argparse.ArgumentParser, config_cls: type) -> None:
    """--config, --resume, --json, and one flag per field of `config_cls` (generated from the
    fields' help: k2_stack.config_flags)."""
    p.add_argument(
        "--config", type=Path, help="JSON or TOML file with the config's fields (flags override it)"
    )
    p.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest train state, exactly (its flags are kept; "
        "changing one is refused by name)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_config_flags(p, config_cls)


def build_config(args: argparse.Namespace, config_cls: type, may_change: set[str] = RESUME_MAY_CHANGE) -> Any:
    """The run's config: the stored one for --resume (flags that would change it are refused by
    name), else --config, else defaults; then the flags."""
    overrides = config_overrides(args, config_cls)
    if args.resume is not None:
        if args.config is not None:
            raise ValueError("--resume continues the stored config; --config cannot be combined with it")
        return resumed_config(args.resume, config_cls, overrides, may_change)
    cfg = config_cls.from_file(args.config) if args.config is not None else config_cls()
    return apply_overrides(cfg, overrides)


def resumed_config(run_dir: Path, config_cls: type, overrides: dict[str, Any], may_change: set[str]) -> Any:
    """The stored config of the run in `run_dir`, for --resume. A flag that would change it is
    refused by name (a changed --steps would restart the schedule, a changed --lr would silently
    make another run); only the `may_change` ones (threads, stop point...) are applied."""
    task = config_cls.task
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ValueError(f"--resume {run_dir}: {saved} not found (not a k2 {task} run dir)")
    stored = json.loads(saved.read_text())
    stored_task = stored.pop("task", "pretrain")
    if stored_task != task:
        raise ValueError(
            f"--resume {run_dir}: that is a `k2 {stored_task}` run; resume it with `k2 {stored_task}`"
        )
    cfg = config_cls.from_dict(stored, source=str(saved))
    out = overrides.get("out")
    if out is not None and Path(out).resolve() != run_dir.resolve():
        raise ValueError(
            f"--resume {run_dir} continues in {run_dir}; --out {out} names another directory. "
            f"Drop --out, or copy the run first (cp -r {run_dir} {out}) and resume that"
        )
    changed = [
        f"--{k.replace('_', '-')} {v} (the run has {get_flat(cfg, k)})"
        for k, v in overrides.items()
        if k not in may_change and k != "out" and get_flat(cfg, k) != v
    ]
    if changed:
        raise ValueError(
            f"--resume {run_dir} continues the run as it was configured; refusing to change "
            + "; ".join(changed)
            + ". Start a new run (--out) to train with other settings."
        )
    # the stored stop point is spent: a resume runs to the end unless --stop-at names a new one
    kept = {"stop_at": 0, **{k: v for k, v in overrides.items() if k in may_change}}
    return apply_overrides(cfg, {"out": str(run_dir), **kept})


class RichProgress:
    """A k2_train callback: a rich progress bar with the step's loss, max logit and throughput."""

    def __init__(self, console, total: int, label: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = console
        self.progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self.total = total
        self.task = None

    def on_fit_start(self, trainer) -> None:
        self.progress.start()
        self.task = self.progress.add_task("steps", total=self.total, completed=trainer.step, info="")

    def on_step_end(self, trainer, m) -> None:
        logit = "-" if m.max_logit is None else f"{m.max_logit:.1f}"
        val = "" if m.val_loss is None else f"  val {m.val_loss:.3f}"
        self.progress.update(
            self.task,
            completed=m.step,
            info=f"loss {m.loss:.3f}{val}  max logit {logit}  clipped {m.clipped_heads}  {m.tokens_per_s:.0f} tok/s",
        )

    def on_interrupt(self, trainer) -> None:
        self.console.print(
            "[yellow]interrupt: finishing this step, then saving the train state "
            "(Ctrl-C again to abort)[/yellow]"
        )

    def on_fit_end(self, trainer, result) -> None:
        self.progress.stop()


def summary_table(result, cfg, task: str):
    from rich.table import Table

    t = Table(title=f"k2 {task}: {result.run_dir}")
    for col in (
        "steps",
        "tokens",
        "final loss",
        "val loss",
        "peak max logit",
        "heads clipped (sum over steps)",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        f"{result.steps_done}/{cfg.steps}",
        f"{result.tokens:,}",
        f"{result.final_loss:.4f}",
        "-" if result.final_val_loss is None else f"{result.final_val_loss:.4f}",
        f"{result.max_logit:.2f}",
        str(result.clipped_heads_total),
    )
    return t


def run(args: argparse.Namespace, config_cls: type) -> int:
    from k2_train import PlainProgress, run_training
    from rich.console import Console

    console = Console()
    task = config_cls.task
    try:
        cfg = build_config(args, config_cls)
        cfg.validate()
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]k2 {task}: {e}[/red]", soft_wrap=True)
        return 2
    for warning in cfg.warnings():
        console.print(f"[yellow]k2 {task}: warning: {warning}[/yellow]", soft_wrap=True)
    callbacks: list = []
    if not args.json:
        callbacks.append(
            RichProgress(console, cfg.steps, task)
            if console.is_terminal
            else PlainProgress(cfg.steps, label=task)
        )
    try:
        result = run_training(
            cfg,
            resume=args.resume is not None,
            callbacks=callbacks,
            log=(lambda _msg: None) if args.json else console.print,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        console.print(f"[red]k2 {task}: {e}[/red]", soft_wrap=True)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
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
        console.print(summary_table(result, cfg, task))
        state = (
            f"stopped early (resume with `k2 {task} --resume {result.run_dir}`)"
            if result.interrupted
            else "done"
        )
        console.print(
            f"{state}; run directory: [bold]{result.run_dir}[/bold] (metrics.jsonl, plots/, state/, tokenizer/)"
        )
    return 130 if result.interrupted and not cfg.stop_at else 0
