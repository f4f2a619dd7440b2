"""`k2 rl`: RL with the K1.5 objective (flags and rendering; the loop is k2_rl.run_rl)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

FLAGS = [
    (
        "init",
        str,
        "the policy to start from: an SFT run dir or an HF-format dir (None: random init of --preset)",
    ),
    ("preset", str, "model preset when there is no --init"),
    ("tasks", str, "task JSONL ({messages, answer}) (None: the generated addition task)"),
    ("heldout", str, "held-out task JSONL for the accuracy (None: the generated task's)"),
    ("reward", str, 'reward name (k2_rl.rewards registry); a task\'s own "reward" field overrides it'),
    (
        "critic_url",
        str,
        (
            "critic of the rubric reward: an OpenAI-compatible API root (e.g. k2 serve's http://HOST:PORT/v1), "
            "or 'policy' (the rollout engine judges through /generate); required with rubric tasks unless the "
            "rollout worker serves an OpenAI chat endpoint"
        ),
    ),
    ("critic_model", str, "model id sent to the critic (None: the first the endpoint lists)"),
    ("critic_refine_pairs", int, "verifiable pairs the critic is checked on per iteration (0 = off)"),
    (
        "rubric_dir",
        str,
        "a directory (or file) of your own rubrics, .json/.toml, read after the shipped ones",
    ),
    ("rubric_aggregation", str, "winrate or bt (Bradley-Terry): how pairwise verdicts become rewards"),
    ("iterations", int, "RL iterations (rollout, reward, update, sync)"),
    ("prompts_per_iteration", int, "prompts per iteration"),
    ("samples_per_prompt", int, "responses sampled per prompt (K)"),
    ("max_response_tokens", int, "response budget; longer responses are cut and penalised"),
    ("truncation_penalty", float, "subtracted from a cut response's reward"),
    ("temperature", float, "rollout temperature at the first iteration"),
    ("temperature_end", float, "rollout temperature at the last iteration (linear decay)"),
    ("loss", str, "k15 (Kimi K1.5's objective) or grpo (clipped, for comparison)"),
    ("rl_tau", float, "K1.5's tau (weight of the log-ratio)"),
    ("ptx_coef", float, "weight of the PTX next-token term (needs --ptx-data)"),
    ("ptx_data", str, "chat JSONL for the PTX term"),
    ("updates_per_iteration", int, "optimizer steps on each iteration's rollouts"),
    ("micro_prompts", int, "prompts per micro-batch (0 = all)"),
    (
        "prompt_sharing",
        str,
        "on: one prompt pass for its K responses in the trainer's forwards; off: row by row; auto: on for a CPU trainer",
    ),
    ("optimizer", str, "muonclip | muon | adamw"),
    ("lr", float, "learning rate (Muon's for muon/muonclip)"),
    ("adamw_lr", float, "AdamW lr of embeddings, head and 1-D params (0 = --lr)"),
    ("tau", float, "QK-Clip threshold"),
    ("ns_dtype", str, "Newton-Schulz dtype: auto (bf16 where bf16 GEMMs are native, else fp32), fp32, bf16"),
    ("eval_every", int, "held-out greedy accuracy every N iterations (0 = never)"),
    ("eval_prompts", int, "held-out prompts to evaluate (0 = all)"),
    ("kl_every", int, "log the KL estimate (one more forward) every N iterations (0 = never)"),
    ("save_every", int, "save the train state every N iterations"),
    ("stop_at", int, "stop after this iteration and save, as an interrupt would"),
    ("rollout", str, "process (a rollout worker synced through k2-ckpt) or inprocess"),
    (
        "free_rollout_cache",
        str,
        "engine switching: the rollout engine frees its KV pool while the trainer runs (auto = on a GPU; on; off)",
    ),
    ("reward_workers", int, "reward worker processes"),
    ("seed", int, "random seed (prompts, sampling, init)"),
    ("threads", int, "torch threads of the trainer (0 = torch's default)"),
    ("rollout_threads", int, "torch threads of the rollout worker (0 = torch's default)"),
    ("device", str, "auto, cpu or cuda"),
    ("ep", int, "under torchrun: routed experts split over N trainer ranks (FSDP2 x EP)"),
]
RESUME_MAY_CHANGE = {"threads", "rollout_threads", "stop_at", "device", "reward_workers", "critic_url"}


def register(sub: argparse._SubParsersAction) -> None:
    from k2_rl.config import RLConfig

    d = RLConfig()
    p = sub.add_parser(
        "rl",
        help="RL with the Kimi K1.5 objective on verifiable tasks (rollouts synced through k2-ckpt)",
        description="Each iteration: sample K responses per prompt with k2-model's engine in a rollout worker, "
        "score them (math-verify in worker processes), take optimizer steps on the K1.5 objective (MuonClip), "
        "push the weights into the worker through k2-ckpt. Writes metrics.jsonl, plots/rl.png and the train state.",
    )
    p.add_argument("--config", type=Path, help="JSON or TOML file with RLConfig fields (flags override it)")
    p.add_argument("--out", type=str, help=f"the run directory (default: {d.out})")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue the run in RUN_DIR exactly")
    for name, typ, help_ in FLAGS:
        p.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=typ, help=f"{help_} (default: {getattr(d, name)})"
        )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
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

    overrides = {name: getattr(args, name) for name, _, _ in FLAGS if getattr(args, name) is not None}
    if args.out is not None:
        overrides["out"] = args.out
    if args.resume is not None:
        from k2_stack.commands.training import resumed_config

        return resumed_config(args.resume, RLConfig, overrides, RESUME_MAY_CHANGE | _extendable(args.resume))
    cfg = RLConfig.from_file(args.config) if args.config is not None else RLConfig()
    return dataclasses.replace(cfg, **overrides)


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
    t_start = time.monotonic()

    def on_iteration(row: dict) -> None:
        if args.json:
            return
        acc = f"  held-out {row['heldout_accuracy']:.1%}" if row.get("heldout_accuracy") is not None else ""
        line = (
            f"rl iteration {row['iteration']}/{cfg.iterations}  reward {row['reward_mean']:.3f}  "
            f"solved {row['solve_rate']:.1%}{acc}  len {row['response_tokens_mean']:.1f}  "
            + (f"kl {row['kl_estimate']:.4f}  " if row.get("kl_estimate") is not None else "")
            + f"rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s "
            f"sync {row['sync_s']:.2f}s  ({time.monotonic() - t_start:.0f}s)"
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
        for col in ("iterations", "optimizer steps", "last reward", "held-out accuracy"):
            t.add_column(col, justify="right")
        acc = "-" if result.heldout_accuracy is None else f"{result.heldout_accuracy:.1%}"
        t.add_row(
            f"{result.iterations_done}/{cfg.iterations}", str(result.steps), f"{result.reward_mean:.3f}", acc
        )
        console.print(t)
        state = (
            f"stopped early (resume with `k2 rl --resume {result.run_dir}`)" if result.interrupted else "done"
        )
        console.print(
            f"{state}; run directory: [bold]{result.run_dir}[/bold] (metrics.jsonl, plots/rl.png, state/)"
        )
    return 130 if result.interrupted and not cfg.stop_at else 0
