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
RESUME_MAY_CHANGE = {"threads", "stop_at", "device", "cache_dir"}


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
    extension = extension_overrides(run_dir, cfg, overrides)
    changed = [
        f"--{k.replace('_', '-')} {v} (the run has {get_flat(cfg, k)})"
        for k, v in overrides.items()
        if k not in may_change and k not in extension and k != "out" and get_flat(cfg, k) != v
    ]
    if changed:
        raise ValueError(
            f"--resume {run_dir} continues the run as it was configured; refusing to change "
            + "; ".join(changed)
            + ". Start a new run (--out) to train with other settings."
        )
    # the stored stop point is spent: a resume runs to the end unless --stop-at names a new one
    kept = {"stop_at": 0, **{k: v for k, v in overrides.items() if k in may_change}, **extension}
    return apply_overrides(cfg, {"out": str(run_dir), **kept})


def extension_overrides(run_dir: Path, cfg: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """{steps, schedule_steps} when `--resume RUN --steps N` extends a pretrain/SFT run past its
    planned end, else {}. The lr of the steps already taken must not change: an extension inside
    the schedule's stable phase is the N-step run exactly; one that would move a decay already
    (partly) taken must say with --schedule-steps what the lr does (keep the finished schedule and
    hold its final lr, or re-warm to the N-step schedule from here)."""
    new_steps = overrides.get("steps")
    schedule = getattr(cfg, "schedule", None)  # the WSD schedule: pretrain/SFT runs only
    if new_steps is None or schedule is None or new_steps == cfg.steps:
        return {}
    from k2_train.state import latest_state, read_state

    latest = latest_state(run_dir)
    done = int(read_state(latest)["step"]) if latest is not None else 0
    if new_steps < max(done, 1) or new_steps < cfg.steps:
        raise ValueError(
            f"--resume {run_dir} --steps {new_steps}: the run plans {cfg.steps} steps and has done "
            f"{done}; a resume may extend it (a larger --steps), not shorten it"
        )
    old_span = schedule.span(cfg.steps)
    new_span = overrides.get("schedule_steps", schedule.schedule_steps) or new_steps
    if "schedule_steps" in overrides or schedule.lr_factors(old_span, done) == schedule.lr_factors(
        new_span, done
    ):
        return {
            "steps": new_steps,
            "schedule_steps": overrides.get("schedule_steps", schedule.schedule_steps),
        }
    floor = schedule.min_lr_ratio
    raise ValueError(
        f"--resume {run_dir} --steps {new_steps}: the run's {old_span}-step schedule has already "
        f"decayed the lr by step {done}, so extending it must say what the lr does next: "
        f"--schedule-steps {old_span} keeps the finished schedule (the {new_steps - done} new steps "
        f"run at its final lr, {floor:g} x --lr), or --schedule-steps {new_steps} re-warms (the lr "
        f"follows the {new_steps}-step schedule from here, back up to --lr, then decays again)"
    )


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
        if m.val_loss is not None:  # every validation result stays on screen, above the bar
            self.progress.console.print(
                f"step {m.step}/{self.total}: loss {m.loss:.4f}  val {m.val_loss:.4f}"
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
