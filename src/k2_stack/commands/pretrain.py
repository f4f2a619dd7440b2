"""`k2 pretrain`: argument parsing and reporting around k2_stack.pretrain."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

# Flags that map one-to-one onto PretrainConfig fields (name, type, help).
_FLAGS = [
    ("preset", str, "model preset (tiny, kimi-k2, deepseek-v3)"),
    ("optimizer", str, "muonclip | muon | adamw"),
    ("lr", float, "peak learning rate (Muon's, with RMS matched to AdamW; AdamW's for --optimizer adamw)"),
    ("adamw_lr", float, "with muon/muonclip: AdamW lr of embeddings, head and 1-D params (0 = --lr)"),
    ("weight_decay", float, "decoupled weight decay"),
    ("tau", float, "QK-Clip threshold (also drawn on the max-logit plot of non-clipping runs)"),
    ("steps", int, "optimizer steps"),
    ("batch", int, "global batch in sequences"),
    ("micro_batch", int, "sequences per forward (gradient accumulation); 0 = whole batch"),
    ("seq_len", int, "tokens per sequence"),
    ("warmup_steps", int, "WSD warmup steps"),
    ("decay_fraction", float, "WSD: fraction of the run spent in the cosine decay"),
    ("grad_clip", float, "gradient-norm clip (0 = off)"),
    ("data", str, "corpus file/dir or tokenized dir (default: this Python's standard library source)"),
    ("tokenizer", str, "tokenizer dir (default: k2-data's bundled BPE)"),
    ("max_corpus_mb", float, "use only the first N MB of the default corpus (0 = all)"),
    ("eval_every", int, "validation loss every N steps (0 = off)"),
    ("save_every", int, "checkpoint every N steps (the last step is always saved)"),
    ("stop_at", int, "stop after this step and checkpoint, as an interrupt would"),
    ("seed", int, "random seed (model init and data order)"),
    ("threads", int, "torch threads (0 = torch's default)"),
    ("dtype", str, "auto (fp32 on CPU, bf16 on GPU), fp32 or bf16"),
    ("device", str, "auto, cpu or cuda"),
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pretrain",
        help="pretrain a K2-architecture model with MuonClip on the embedded default data",
        description="Pretrain a K2-architecture model (MuonClip, WSD schedule, aux-loss-free balancing). "
        "Writes metrics.jsonl, plots, the tokenizer and atomic checkpoints into --out.",
    )
    p.add_argument("--config", type=Path, help="JSON or TOML file with PretrainConfig fields (flags override it)")
    p.add_argument("--out", type=str, help="the run directory")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--activation-checkpointing", choices=["none", "full", "selective"], default=None,
                   help="recompute layers in backward: every layer (full) or every other layer (selective)")
    p.add_argument("--attention", choices=["auto", "fused", "sdpa", "eager"], default=None,
                   help="attention path: auto (the fused k2_kernels kernel where it serves the device), "
                        "fused, sdpa or eager")
    for name, typ, help_ in _FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, help=help_)
    p.add_argument("--document-mask", action="store_true", default=None,
                   help="attend only within each packed document (positions restart per document)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    from k2_stack.pretrain import PretrainConfig

    if args.resume is not None:
        saved = args.resume / "config.json"
        if not saved.is_file():
            raise SystemExit(f"k2 pretrain: --resume {args.resume}: {saved} not found (not a k2 pretrain run dir)")
        cfg = PretrainConfig.from_dict(json.loads(saved.read_text()), source=str(saved))
        cfg.out = str(args.resume)
        cfg.stop_at = 0
    elif args.config is not None:
        cfg = PretrainConfig.from_file(args.config)
    else:
        cfg = PretrainConfig()
    overrides = {name: getattr(args, name) for name, _, _ in _FLAGS if getattr(args, name) is not None}
    if args.out is not None:
        overrides["out"] = args.out
    if args.document_mask:
        overrides["document_mask"] = True
    if args.activation_checkpointing is not None:
        overrides["activation_checkpointing"] = args.activation_checkpointing
    if args.attention is not None:
        overrides["attention"] = args.attention
    return dataclasses.replace(cfg, **overrides)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from k2_stack.pretrain.trainer import run_pretrain, summary_table

    console = Console()
    cfg = build_config(args)
    try:
        result = run_pretrain(cfg, resume=args.resume is not None, console=console, quiet=args.json)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        console.print(f"[red]k2 pretrain: {e}[/red]")
        return 2
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return 0
    if args.json:
        print(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()
                          if k != "plots"}))
    else:
        console.print(summary_table(result, cfg))
        state = "stopped early (resume with `k2 pretrain --resume " + str(result.run_dir) + "`)" if result.interrupted else "done"
        console.print(f"{state}; run directory: [bold]{result.run_dir}[/bold] (metrics.jsonl, plots/, checkpoints/, tokenizer/)")
    return 130 if result.interrupted and not cfg.stop_at else 0
