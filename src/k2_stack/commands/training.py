"""What `k2 pretrain` and `k2 sft` share: their flags, config building (with resume rules), the
progress display (a rich bar on a terminal, a plain line every few seconds elsewhere) and the
summary. The loop itself is k2_train.run_training."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

# Flags that map one-to-one onto the config fields (name, type, help).
FLAGS = [
    ("preset", str, "model preset (tiny, kimi-k2, deepseek-v3)"),
    ("optimizer", str, "muonclip | muon | adamw"),
    ("lr", float, "peak learning rate (Muon's, with RMS matched to AdamW; AdamW's for --optimizer adamw)"),
    ("adamw_lr", float, "with muon/muonclip: AdamW lr of embeddings, head and 1-D params (0 = --lr)"),
    ("weight_decay", float, "decoupled weight decay"),
    ("tau", float, "QK-Clip threshold (also drawn on the max-logit plot of non-clipping runs)"),
    ("ns_dtype", str, "Newton-Schulz dtype: auto (bf16 where bf16 GEMMs are native, else fp32), fp32, bf16"),
    ("steps", int, "optimizer steps"),
    ("batch", int, "global batch in sequences"),
    ("micro_batch", int, "sequences per forward (gradient accumulation); 0 = whole batch"),
    ("seq_len", int, "tokens per sequence"),
    ("warmup_steps", int, "WSD warmup steps"),
    ("decay_fraction", float, "WSD: fraction of the run spent in the cosine decay"),
    ("grad_clip", float, "gradient-norm clip (0 = off)"),
    ("tokenizer", str, "tokenizer dir (default: k2-data's bundled BPE)"),
    ("val_fraction", float, "fraction of documents held out for the validation loss"),
    ("eval_every", int, "validation loss every N steps (0 = off)"),
    ("save_every", int, "save the train state every N steps (the last step is always saved)"),
    ("stop_at", int, "stop after this step and save the train state, as an interrupt would"),
    ("seed", int, "random seed (model init and data order)"),
    ("threads", int, "torch threads (0 = torch's default)"),
    ("dtype", str, "auto (fp32 on CPU, bf16 on GPU), fp32 or bf16"),
    ("device", str, "auto, cpu or cuda"),
    ("ep", int, "expert parallelism under torchrun: routed experts split over N ranks (FSDP2 x EP)"),
]
# Flags a resumed run may change: they do not change what is computed.
RESUME_MAY_CHANGE = {"threads", "stop_at", "device"}


def add_common_flags(
    p: argparse.ArgumentParser, config_cls: type, extra: list[tuple[str, type, str]]
) -> None:
    defaults = config_cls()
    p.add_argument(
        "--config", type=Path, help="JSON or TOML file with the config's fields (flags override it)"
    )
    p.add_argument("--out", type=str, help=f"the run directory (default: {defaults.out})")
    p.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest train state, exactly (its flags are kept; "
        "changing one is refused by name)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=["none", "full", "selective"],
        default=None,
        help="recompute layers in backward: every layer (full) or every other layer (selective) "
        f"(default: {defaults.activation_checkpointing})",
    )
    p.add_argument(
        "--attention",
        choices=["auto", "fused", "sdpa", "eager"],
        default=None,
        help="attention path: auto (the fused k2_kernels kernel where it serves the device), "
        f"fused, sdpa or eager (default: {defaults.attention})",
    )
    for name, typ, help_ in FLAGS + extra:
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=typ,
            help=f"{help_} (default: {getattr(defaults, name)})",
        )
    p.add_argument(
        "--document-mask",
        action="store_true",
        default=None,
        help=f"attend only within each packed document (default: {defaults.document_mask})",
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def build_config(args: argparse.Namespace, config_cls: type, extra: list[tuple[str, type, str]]) -> Any:
    """The run's config: the stored one for --resume (flags that would change it are refused by
    name), else --config, else defaults; then the flags."""
    overrides = {name: getattr(args, name) for name, _, _ in FLAGS + extra if getattr(args, name) is not None}
    if args.out is not None:
        overrides["out"] = args.out
    if args.document_mask:
        overrides["document_mask"] = True
    if args.activation_checkpointing is not None:
        overrides["activation_checkpointing"] = args.activation_checkpointing
    if args.attention is not None:
        overrides["attention"] = args.attention
    if args.resume is not None:
        if args.config is not None:
            raise ValueError("--resume continues the stored config; --config cannot be combined with it")
        return resumed_config(args.resume, config_cls, overrides, RESUME_MAY_CHANGE)
    cfg = config_cls.from_file(args.config) if args.config is not None else config_cls()
    return dataclasses.replace(cfg, **overrides)


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
    changed = [
        f"--{k.replace('_', '-')} {v} (the run has {getattr(cfg, k)})"
        for k, v in overrides.items()
        if k not in may_change and k != "out" and getattr(cfg, k) != v
    ]
    if changed:
        raise ValueError(
            f"--resume {run_dir} continues the run as it was configured; refusing to change "
            + "; ".join(changed)
            + ". Start a new run (--out) to train with other settings."
        )
    # the stored stop point is spent: a resume runs to the end unless --stop-at names a new one
    kept = {"stop_at": 0, **{k: v for k, v in overrides.items() if k in may_change}}
    return dataclasses.replace(cfg, out=str(run_dir), **kept)


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


def run(args: argparse.Namespace, config_cls: type, extra: list[tuple[str, type, str]]) -> int:
    from k2_train import PlainProgress, run_training
    from rich.console import Console

    console = Console()
    task = config_cls.task
    try:
        cfg = build_config(args, config_cls, extra)
        cfg.validate()
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]k2 {task}: {e}[/red]", soft_wrap=True)
        return 2
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
