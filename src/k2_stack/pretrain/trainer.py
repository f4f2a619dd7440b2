"""The pretraining loop: K2ForCausalLM + MuonClip (or Muon / AdamW) + the packed Arrow loader.

One step = `batch` sequences split into micro-batches (gradient accumulation), gradient-norm
clipping, the optimizer step (MuonClip clips the heads whose max logit passed tau, using the
logits recorded over all micro-batches of the step), the WSD schedule, and the aux-loss-free
expert-bias update. Every step appends one JSON line to `metrics.jsonl`; checkpoints are atomic
and hold everything needed to continue bit for bit (model, optimizer, scheduler, loader, RNG).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from k2_model import K2Config, K2ForCausalLM
from k2_optim import MuonClip, wsd_schedule
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from k2_stack.pretrain import checkpoint as ckpt
from k2_stack.pretrain import distributed as dd
from k2_stack.pretrain.config import PretrainConfig
from k2_stack.pretrain.data import build_datasets, build_loader, prepare_tokenized
from k2_stack.pretrain.plots import plot_runs, read_metrics

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


def resolve_device(cfg: PretrainConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    return device, dtype


def build_model(cfg: PretrainConfig, vocab_size: int, device: torch.device) -> K2ForCausalLM:
    config = K2Config.preset(cfg.preset, **cfg.model_overrides)
    if config.vocab_size < vocab_size:
        raise ValueError(
            f"preset {cfg.preset!r} has vocab_size={config.vocab_size}, smaller than the tokenizer's "
            f"{vocab_size}; set model_overrides.vocab_size"
        )
    torch.manual_seed(cfg.seed)
    model = K2ForCausalLM(config).to(device)
    model.set_attention_impl(cfg.attention)
    if cfg.activation_checkpointing != "none":
        enable_activation_checkpointing(model, every=1 if cfg.activation_checkpointing == "full" else 2)
    return model


def describe_attention(model: K2ForCausalLM, cfg: PretrainConfig, device: torch.device) -> str:
    """Which attention path training uses, for the start-up line."""
    from k2_model.model import fused_attention_available

    c = model.config
    fused = fused_attention_available(device, c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    if cfg.attention == "auto":
        return "fused (k2_kernels)" if fused else "sdpa/eager (no compiled k2_kernels attention here)"
    return cfg.attention


def enable_activation_checkpointing(model: K2ForCausalLM, every: int = 1) -> None:
    """Recompute every `every`-th decoder layer in backward instead of keeping its activations.

    The recomputed forward runs in training mode, so it would count its tokens into the routers'
    expert loads a second time; its context restores the loads afterwards. (The max logits it
    re-records are the same values, and a max is unchanged by a repeat.)"""
    from torch.utils.checkpoint import checkpoint

    for i, layer in enumerate(model.model.layers):
        if i % every:
            continue
        inner = layer.forward
        routers = [m for m in layer.modules() if isinstance(getattr(m, "expert_load", None), torch.Tensor)]

        def contexts(_routers=routers):
            return contextlib.nullcontext(), _keep_expert_loads(_routers)

        def forward(*args: Any, _inner=inner, _contexts=contexts, **kwargs: Any) -> torch.Tensor:
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        layer.forward = forward  # type: ignore[method-assign]


@contextlib.contextmanager
def _keep_expert_loads(routers: list[nn.Module]):
    saved = [r.expert_load.clone() for r in routers]
    try:
        yield
    finally:
        for r, load in zip(routers, saved):
            r.expert_load.copy_(load)


def build_optimizer(cfg: PretrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
        )
    # Muon for hidden matrices, AdamW for embeddings / head / 1-D; QK-Clip only for "muonclip".
    opt = MuonClip(model, lr=cfg.lr, weight_decay=cfg.weight_decay, tau=cfg.tau if cfg.optimizer == "muonclip" else None)
    if cfg.adamw_lr:
        for group in opt.param_groups:
            if group.get("algorithm") == "adamw":
                group["lr"] = cfg.adamw_lr
    return opt


def wsd_for(cfg: PretrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    warmup = min(cfg.warmup_steps, cfg.steps)
    decay = min(int(round(cfg.steps * cfg.decay_fraction)), cfg.steps - warmup)
    return wsd_schedule(optimizer, warmup, cfg.steps - warmup - decay, decay, cfg.min_lr_ratio)


@torch.no_grad()
def evaluate(model: K2ForCausalLM, val, cfg: PretrainConfig, device: torch.device, autocast) -> float:
    """Mean loss over the first `eval_batches` batches of the held-out split (a fixed set)."""
    was_training = model.training
    model.eval()
    losses = []
    n = min(cfg.eval_batches * cfg.batch, len(val))
    bs = cfg.micro_batch or cfg.batch
    for start in range(0, n, bs):
        samples = [val[g] for g in range(start, min(start + bs, n))]
        b = {k: torch.stack([torch.from_numpy(s[k]) for s in samples]).long().to(device) for k in samples[0]}
        with autocast():
            loss = lm_loss(model, b["input_ids"], b["labels"], b.get("position_ids"), b.get("doc_ids"))
        losses.append(float(loss) * len(samples))
    model.train(was_training)
    return sum(losses) / max(n, 1)


def lm_loss(
    model: K2ForCausalLM, input_ids_BS: torch.Tensor, labels_BS: torch.Tensor,
    position_ids_BS: torch.Tensor | None = None, doc_ids_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of the loader's labels, which are already the next tokens (aligned with
    the inputs), so every label of the packed stream counts; -100 is ignored. With a document
    mask, positions restart per document and attention stays inside it."""
    logits_BSV = model(input_ids_BS, position_ids=position_ids_BS, document_ids=doc_ids_BS).logits
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten(), ignore_index=-100)


@torch.no_grad()
def post_clip_max_logit(model: K2ForCausalLM, input_ids_BS: torch.Tensor, autocast) -> float:
    """The max logit the just-updated weights give on this input (a training-mode forward, so the
    model records it), leaving no trace in the max-logit record or the expert-load counts."""
    model.reset_attention_max_logits()
    with autocast():
        model(input_ids_BS)
    value = float(model.attention_max_logits().max())
    model.reset_attention_max_logits()
    for router in model.moe_routers():
        router.expert_load.zero_()
    return value


def _expert_balance(load_LE: torch.Tensor) -> float:
    """MaxVio (Wang et al., aux-loss-free balancing): mean over layers of (max load / mean load) - 1."""
    if load_LE.numel() == 0:
        return 0.0
    load = load_LE.float()
    mean = load.mean(dim=-1).clamp_min(1e-9)
    return float((load.max(dim=-1).values / mean - 1.0).mean())


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop lines logged after the checkpoint (they will be logged again)."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def run_pretrain(
    cfg: PretrainConfig, resume: bool = False, console: Console | None = None, quiet: bool = False
) -> RunResult:
    """Train (or continue, with `resume=True`, the run in `cfg.out`) and return a summary."""
    console = console or Console()
    cfg.validate()
    run_dir = Path(cfg.out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device, dtype = resolve_device(cfg)
    info = dd.init_distributed(device.type)
    try:
        return _run(cfg, resume, console, quiet, run_dir, device, dtype, info)
    finally:
        dd.shutdown(info)


def _run(
    cfg: PretrainConfig, resume: bool, console: Console, quiet: bool, run_dir: Path,
    device: torch.device, dtype: torch.dtype, info: dd.DistInfo,
) -> RunResult:
    if device.type == "cuda" and info.enabled:
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if cfg.batch % info.world_size:
        raise ValueError(f"--batch {cfg.batch} (global) is not divisible by the {info.world_size} processes")
    per_rank = cfg.batch // info.world_size
    micro = cfg.micro_batch or per_rank
    if per_rank % micro:
        raise ValueError(f"--micro-batch {micro} does not divide the per-process batch {per_rank}")
    accum = per_rank // micro
    quiet = quiet or not info.is_main

    start_state = None
    if resume:
        latest = ckpt.latest_checkpoint(run_dir)
        if latest is None:
            raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
        start_state = ckpt.load_checkpoint(latest)
    elif run_dir.exists() and ckpt.latest_checkpoint(run_dir) is not None:
        raise FileExistsError(f"{run_dir} already holds a run; continue it with --resume {run_dir} or pick a new --out")
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{CONFIG}.tmp"
        tmp.write_text(json.dumps(cfg.to_dict(), indent=2))
        os.replace(tmp, run_dir / CONFIG)

    # data (tokenized once, by rank 0)
    tokenized = None
    if info.is_main:
        with console.status("tokenizing the corpus (cached after the first run)..."):
            tokenized = prepare_tokenized(cfg)
    tokenized = dd.broadcast_object(tokenized, info)
    train_ds, val_ds = build_datasets(cfg, tokenized)
    if val_ds is None and cfg.eval_every and not quiet:
        console.print(f"[yellow]no held-out documents at val_fraction={cfg.val_fraction}: validation is off[/yellow]")
    if info.is_main and not (run_dir / "tokenizer").exists():
        shutil.copytree(train_ds.tokenizer_dir, run_dir / "tokenizer")
    loader = build_loader(train_ds, per_rank, rank=info.rank, world_size=info.world_size)

    # model, optimizer, schedule
    model = build_model(cfg, train_ds.vocab_size, device)
    model.train()
    if info.enabled:
        dd.shard_model(model, dtype)
    optimizer = build_optimizer(cfg, model)
    scheduler = wsd_for(cfg, optimizer)
    step = 0
    if start_state is not None:
        if start_state.get("optimizer") is None:
            raise ValueError(
                f"{run_dir}: the checkpoint of a {start_state.get('world_size')}-process run holds no optimizer "
                "state, so it cannot be resumed exactly (export it with `k2 export` instead)"
            )
        if int(start_state.get("world_size", 1)) != info.world_size:
            raise ValueError(
                f"{run_dir}: the checkpoint was written by {start_state.get('world_size', 1)} process(es); "
                f"resume it with the same number (now {info.world_size})"
            )
        dd.load_full_state(model, optimizer, start_state["model"], start_state["optimizer"], info)
        scheduler.load_state_dict(start_state["scheduler"])
        loader.load_state_dict(start_state["loader"])
        torch.set_rng_state(start_state["rng"]["torch"])
        step = int(start_state["step"])
        if info.is_main:
            _truncate_metrics(run_dir / METRICS, step)

    def autocast():
        # One process: fp32 master weights, bf16 matmuls by autocast. Under FSDP2 its mixed-
        # precision policy already casts the parameters to bf16 (and reduces in fp32).
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16 and not info.enabled)

    def state() -> dict[str, Any]:
        return {
            "step": step,
            "config": cfg.to_dict(),
            "world_size": info.world_size,
            # full (unsharded) model and optimizer state, keyed by parameter names: exports and
            # resumes like a 1-process checkpoint (with the same number of processes)
            "model": dd.full_model_state_dict(model, info),
            "optimizer": dd.full_optimizer_state_dict(model, optimizer, info),
            "scheduler": scheduler.state_dict(),
            "loader": loader.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
        }

    n_params = sum(p.numel() for p in model.parameters())
    if not quiet:
        console.print(
            f"[bold]k2 pretrain[/bold]: {cfg.preset} ({n_params / 1e6:.2f}M params) with {cfg.optimizer} "
            f"(lr {cfg.lr:g}, wd {cfg.weight_decay:g}" + (f", tau {cfg.tau:g}" if cfg.optimizer == "muonclip" else "")
            + f"), {cfg.steps} steps x {cfg.batch} x {cfg.seq_len} tokens on {device} ({str(dtype).split('.')[-1]})"
            + (f" x {info.world_size} processes (FSDP2)" if info.enabled else "") + "; "
            f"data {tokenized} ({len(train_ds)} train / {len(val_ds) if val_ds else 0} val samples per epoch); run dir {run_dir}"
            + (f"; resuming after step {step}" if start_state is not None else "")
            + f"; attention: {describe_attention(model, cfg, device)}"
        )

    # Ctrl-C: finish the current step, checkpoint, exit cleanly.
    interrupted = False

    def on_sigint(signum, frame):  # noqa: ARG001
        nonlocal interrupted
        if interrupted:
            raise KeyboardInterrupt
        interrupted = True
        console.print("[yellow]interrupt: finishing this step, then saving a checkpoint (Ctrl-C again to abort)[/yellow]")

    previous_handler = signal.signal(signal.SIGINT, on_sigint) if _in_main_thread() else None
    metrics_f = open(run_dir / METRICS, "a") if info.is_main else None
    last: dict[str, Any] = {}
    clipped_total = 0
    tokens_per_step = cfg.batch * cfg.seq_len
    progress = Progress(
        TextColumn("[bold]pretrain"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(), console=console, disable=quiet, transient=False,
    )
    try:
        with progress:
            task = progress.add_task("steps", total=cfg.steps, completed=step, info="")
            while step < cfg.steps and not interrupted:
                t0 = time.perf_counter()
                wait0 = loader.wait_s
                batch = next(loader)
                loader_s = loader.wait_s - wait0
                ids_BS = batch["input_ids"].to(device)
                labels_BS = batch["labels"].to(device)
                pos_BS = batch["position_ids"].to(device) if "position_ids" in batch else None
                doc_BS = batch["doc_ids"].to(device) if "doc_ids" in batch else None
                loss_sum = 0.0
                for m in range(accum):
                    sl = slice(m * micro, (m + 1) * micro)
                    with autocast():
                        micro_loss = lm_loss(
                            model, ids_BS[sl], labels_BS[sl],
                            None if pos_BS is None else pos_BS[sl], None if doc_BS is None else doc_BS[sl],
                        )
                    (micro_loss / accum).backward()
                    loss_sum += float(micro_loss.detach())
                loss = dd.all_reduce_scalar(loss_sum / accum, "mean", info, device)
                # The step's max logit over all ranks, before any clip (MuonClip resets the record itself).
                max_logit = dd.all_reduce_scalar(float(model.attention_max_logits().max()), "max", info, device)
                grad_norm = dd.to_float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf))
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                if isinstance(optimizer, MuonClip) and optimizer.tau is not None:
                    stats = optimizer.last_clip_stats()
                    clipped = int(stats["num_clipped"])
                    frac_ever = float(stats["fraction_ever_clipped"])
                else:
                    model.reset_attention_max_logits()
                    clipped, frac_ever = 0, 0.0
                load_LE = model.update_expert_bias(cfg.bias_update_speed)
                after_clip = post_clip_max_logit(model, ids_BS[:micro], autocast) if cfg.log_post_clip_logit else None
                step += 1
                clipped_total += clipped
                dt = time.perf_counter() - t0
                row: dict[str, Any] = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "max_logit": max_logit,
                    "clipped_heads": clipped,
                    "fraction_heads_ever_clipped": frac_ever,
                    "expert_maxvio": _expert_balance(load_LE),
                    "tokens": step * tokens_per_step,
                    "tokens_per_s": tokens_per_step / dt,
                    "step_s": dt,
                    "loader_s": loader_s,
                }
                if after_clip is not None:
                    row["max_logit_after_clip"] = after_clip
                if val_ds is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    row["val_loss"] = evaluate(model, val_ds, cfg, device, autocast)
                if metrics_f is not None:
                    metrics_f.write(json.dumps(row) + "\n")
                    metrics_f.flush()
                last = row
                progress.update(
                    task, completed=step,
                    info=f"loss {loss:.3f}  max logit {max_logit:.1f}  clipped {clipped}  {row['tokens_per_s']:.0f} tok/s",
                )
                if info.enabled:  # an interrupt on any rank stops every rank at the same step
                    interrupted = bool(dd.all_reduce_scalar(float(interrupted), "max", info, device))
                stop_here = cfg.stop_at and step == cfg.stop_at
                if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stop_here or interrupted:
                    snapshot = state()  # a collective under FSDP2: every rank takes part
                    if info.is_main:
                        ckpt.save_checkpoint(run_dir, step, snapshot)
                if stop_here:
                    interrupted = True
    finally:
        if metrics_f is not None:
            metrics_f.close()
        loader.close()
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)

    dd.barrier(info)
    rows = read_metrics(run_dir / METRICS)
    plots = plot_runs([(cfg.optimizer, rows)], run_dir / "plots", tau=cfg.tau) if info.is_main else []
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return RunResult(
        run_dir=run_dir,
        steps_done=step,
        tokens=step * tokens_per_step,
        final_loss=float(last.get("loss", float("nan"))) if last else (rows[-1]["loss"] if rows else float("nan")),
        final_val_loss=vals[-1] if vals else None,
        max_logit=max((r["max_logit"] for r in rows), default=float("nan")),
        clipped_heads_total=sum(r["clipped_heads"] for r in rows),
        interrupted=step < cfg.steps,
        plots=plots,
    )


def summary_table(result: RunResult, cfg: PretrainConfig) -> Table:
    t = Table(title=f"k2 pretrain: {result.run_dir}")
    t.add_column("steps", justify="right")
    t.add_column("tokens", justify="right")
    t.add_column("final loss", justify="right")
    t.add_column("val loss", justify="right")
    t.add_column("peak max logit", justify="right")
    t.add_column("heads clipped (sum over steps)", justify="right")
    t.add_row(
        f"{result.steps_done}/{cfg.steps}",
        f"{result.tokens:,}",
        f"{result.final_loss:.4f}",
        "-" if result.final_val_loss is None else f"{result.final_val_loss:.4f}",
        f"{result.max_logit:.2f}",
        str(result.clipped_heads_total),
    )
    return t


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
