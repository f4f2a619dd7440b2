"""A whole training run from a config: `k2 pretrain` and `k2 sft` are this plus flag parsing.

`run_training(cfg)` composes the pieces: it joins the process group (under torchrun), tokenizes
the data once (rank 0, cached), builds the model (`k2_model.parallelize`: activation
checkpointing, FSDP2 with more than one process), the optimizer and schedule, the Trainer with
the task's loss, and the train state (model, optimizer, scheduler, loader position, RNG, trainer
step); resumes it with `resume=True`; fits; plots; returns a summary. The run directory gets
`config.json`, `metrics.jsonl`, `plots/`, `tokenizer/` and `state/`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from k2_model.parallelize import parallelize

from k2_train import distributed as dd
from k2_train.builders import (
    build_model,
    build_optimizer,
    build_schedule,
    describe_attention,
    describe_ns_dtype,
    resolve_device,
)
from k2_train.config import PretrainConfig
from k2_train.data import build_datasets, build_loader, mixture_sources, prepare_tokenized
from k2_train.losses import Loss, NextTokenLoss
from k2_train.metrics import Callback, JSONLMetrics, read_metrics
from k2_train.state import ModelState, OptimizerState, RNGState, TrainState, latest_state
from k2_train.trainer import Trainer

METRICS = "metrics.jsonl"
CONFIG = "config.json"


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    tokens: int
    final_loss: float
    final_val_loss: float | None
    max_logit: float
    clipped_heads_total: int
    interrupted: bool
    plots: list[Path] = field(default_factory=list)


def run_training(
    cfg: PretrainConfig,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    loss: Loss | None = None,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Train (or continue, with `resume=True`, the run in `cfg.out`) and return a summary.

    `callbacks` receive every step's metrics on rank 0 (after the run's own metrics.jsonl
    writer); `loss` defaults to next-token cross-entropy (masked by the data for SFT); `log`
    receives the start-up lines on rank 0 (default: print)."""
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device, dtype = resolve_device(cfg)
    info = dd.init_distributed(device.type)
    try:
        return _run(cfg, resume, list(callbacks), loss or NextTokenLoss(), log or print, device, dtype, info)
    finally:
        dd.shutdown(info)


def _run(
    cfg: PretrainConfig,
    resume: bool,
    callbacks: list[Callback],
    loss: Loss,
    log: Callable[[str], None],
    device: torch.device,
    dtype: torch.dtype,
    info: dd.DistInfo,
) -> RunResult:
    run_dir = Path(cfg.out)
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if cfg.batch % info.world_size:
        raise ValueError(f"--batch {cfg.batch} (global) is not divisible by the {info.world_size} processes")
    per_rank = cfg.batch // info.world_size
    if cfg.micro_batch and per_rank % cfg.micro_batch:
        raise ValueError(f"--micro-batch {cfg.micro_batch} does not divide the per-process batch {per_rank}")
    if not info.is_main:
        log = _silent
    if resume and latest_state(run_dir) is None:
        raise FileNotFoundError(f"--resume {run_dir}: no complete train state under {run_dir / 'state'}")
    if not resume and latest_state(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick a new --out"
        )
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{CONFIG}.tmp"
        tmp.write_text(json.dumps(dict(cfg.to_dict(), task=cfg.task), indent=2))
        os.replace(tmp, run_dir / CONFIG)

    # data (tokenized once, by rank 0)
    tokenized = None
    if info.is_main:
        log("preparing data (tokenized once, then cached)...")
        tokenized = prepare_tokenized(cfg)
        for source in tokenized if isinstance(tokenized, list) else [tokenized]:
            _report_skipped(source, log)
    tokenized = dd.broadcast_object(tokenized, info)
    train_ds, val_ds = build_datasets(cfg, tokenized)
    if val_ds is None and cfg.eval_every:
        log(f"no held-out documents at val_fraction={cfg.dataset.val_fraction}: validation is off")
    if info.is_main:
        _report_truncated(train_ds, cfg, log)
    if info.is_main and not (run_dir / "tokenizer").exists():
        shutil.copytree(train_ds.tokenizer_dir, run_dir / "tokenizer")
    loader = build_loader(train_ds, per_rank, rank=info.rank, world_size=info.world_size)

    # model, optimizer, schedule
    model = build_model(cfg.model, train_ds.vocab_size, device, cfg.seed)
    model.train()
    cfg.validate_layout(info.world_size, model.config.n_routed_experts)
    parallelize(
        model,
        data_parallel=info.enabled,
        compute_dtype=dtype,
        activation_checkpointing=cfg.activation_checkpointing,
        ep=cfg.ep,
    )
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, cfg.steps)
    # One process: fp32 master weights, bf16 matmuls by autocast. Under FSDP2 its mixed-precision
    # policy already casts the parameters to bf16 (and reduces in fp32).
    autocast = torch.bfloat16 if dtype == torch.bfloat16 and not info.enabled else None
    trainer = Trainer(
        model,
        optimizer,
        loss,
        scheduler,
        config=cfg.trainer_config(),
        info=info,
        device=device,
        autocast_dtype=autocast,
        callbacks=[JSONLMetrics(run_dir / METRICS), *callbacks],
    )
    state = TrainState(
        run_dir,
        {
            "model": ModelState(model, info),
            "optimizer": OptimizerState(model, optimizer, info),
            "scheduler": scheduler,
            "loader": loader,
            "rng": RNGState(),
            "trainer": trainer,
        },
        info=info,
        meta={
            "config": cfg.to_dict(),
            "task": cfg.task,
            "model_config": model.config.to_hf(),
            # the chat layout the data was rendered in: `k2 export` writes it as the chat template
            "chat_template": chat_template_of(tokenized),
        },
        layout={"ep": cfg.ep},
    )
    if resume:
        state.load()
        if cfg.stop_at and cfg.stop_at <= trainer.step:  # never reached: the run would go on to the end
            raise ValueError(
                f"--stop-at {cfg.stop_at}: the run in {run_dir} has done {trainer.step} steps already; "
                f"give a later one (or none, to run to --steps {cfg.steps})"
            )

    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"k2 {cfg.task}: {_model_name(cfg)} ({n_params / 1e6:.2f}M params) with {cfg.optim.optimizer} "
        f"(lr {cfg.optim.lr:g}, wd {cfg.optim.weight_decay:g}"
        + (f", tau {cfg.optim.tau:g}" if cfg.optim.optimizer == "muonclip" else "")
        + f"), {cfg.steps} steps x {cfg.batch} x {cfg.dataset.seq_len} tokens on {device} ({str(dtype).split('.')[-1]})"
        + (f" x {info.world_size} processes (FSDP2)" if info.enabled and cfg.ep == 1 else "")
        + (f" x {info.world_size} processes (FSDP2 x EP{cfg.ep})" if cfg.ep > 1 else "")
        + "; "
        f"data {_describe_data(cfg, tokenized)} ({len(train_ds)} train / {len(val_ds) if val_ds else 0} val samples per epoch); "
        f"run dir {run_dir}"
        + (f"; resuming after step {trainer.step}" if resume else "")
        + f"; attention: {describe_attention(model, cfg.model.attention, device)}"
        + f"; Newton-Schulz: {describe_ns_dtype(cfg.optim, device)}"
    )

    def eval_batches():
        n = min(cfg.eval_batches * cfg.batch, len(val_ds))
        bs = cfg.micro_batch or cfg.batch
        for start in range(0, n, bs):
            samples = [val_ds[g] for g in range(start, min(start + bs, n))]
            yield {k: torch.stack([torch.from_numpy(s[k]) for s in samples]).long() for k in samples[0]}

    try:
        result = trainer.fit(loader, state=state, eval_batches=eval_batches if val_ds is not None else None)
    finally:
        loader.close()
    dd.barrier(info)

    rows = read_metrics(run_dir / METRICS) if (run_dir / METRICS).is_file() else []
    plots: list[Path] = []
    if info.is_main and rows:
        from k2_train.plots import plot_runs

        plots = plot_runs([(cfg.optim.optimizer, rows)], run_dir / "plots", tau=cfg.optim.tau)
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    logits = [r["max_logit"] for r in rows if r.get("max_logit") is not None]
    return RunResult(
        run_dir=run_dir,
        steps_done=result.steps_done,
        tokens=trainer.tokens,
        final_loss=float(rows[-1]["loss"]) if rows else float("nan"),
        final_val_loss=vals[-1] if vals else None,
        max_logit=max(logits, default=float("nan")),
        clipped_heads_total=sum(r.get("clipped_heads", 0) for r in rows),
        interrupted=result.interrupted,
        plots=plots,
    )


def _describe_data(cfg: PretrainConfig, tokenized: Path | list[Path]) -> str:
    if not isinstance(tokenized, list):
        return str(tokenized)
    weights = [w for _, w in mixture_sources(cfg) or []]
    return "mix of " + ", ".join(f"{t} ({w:g})" for t, w in zip(tokenized, weights))


def chat_template_of(tokenized: Path | list[Path]) -> str:
    """The chat template a tokenized chat dataset was rendered with (its manifest's
    `chat_template`; k2's own variant for older datasets and for plain text)."""
    from k2_data.chat.render import K2_TEMPLATE

    first = tokenized[0] if isinstance(tokenized, list) else tokenized
    try:
        manifest = json.loads((Path(first) / "manifest.json").read_text())
    except (OSError, ValueError):
        return K2_TEMPLATE
    return manifest.get("chat_template") or K2_TEMPLATE


def truncation_note(dataset, seq_len: int) -> str | None:
    """A line about documents longer than `seq_len` under whole-document packing (cut at
    seq_len: with SFT data, turns past the cut are not trained), or None when none are."""
    cut = getattr(dataset, "num_truncated", 0)
    if not cut:
        return None
    lengths = sorted(int(n) for n in dataset.document_lengths)
    median, longest = lengths[len(lengths) // 2], lengths[-1]
    return (
        f"{cut} of {dataset.num_docs} documents are longer than --seq-len {seq_len} "
        f"(median {median}, longest {longest} tokens) and are cut at {seq_len} tokens: what lies "
        f"past the cut is not trained on; --seq-len {longest} keeps them whole"
    )


def _report_truncated(dataset, cfg: PretrainConfig, log: Callable[[str], None]) -> None:
    note = truncation_note(dataset, cfg.dataset.seq_len)
    if note:
        log(f"warning: {note}")


def _report_skipped(tokenized: Path, log: Callable[[str], None], show: int = 10) -> None:
    """Bad records are never trained on silently: say how many were skipped, and where."""
    from k2_data import load_manifest

    skipped = load_manifest(tokenized).get("skipped", [])
    if not skipped:
        return
    log(f"skipped {len(skipped)} bad record(s) of the data (listed in {tokenized / 'manifest.json'}):")
    for rec in skipped[:show]:
        log(f"  {rec['file']}:{rec['where']}: {rec['reason']}")
    if len(skipped) > show:
        log(f"  ... and {len(skipped) - show} more")


def _model_name(cfg: PretrainConfig) -> str:
    spec = cfg.model
    return f"{spec.preset} from {spec.init}" if spec.init else spec.preset


def _silent(_: str) -> None:
    pass


__all__ = ["RunResult", "run_training"]
