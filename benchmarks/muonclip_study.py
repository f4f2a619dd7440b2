"""The K2 paper's MuonClip claims, at small scale, side by side (issue: pretraining, section 5).

Runs `k2 pretrain` on the default corpus (this Python's standard library source) with the tiny
K2 preset for several optimizer settings, all on the same data and tokens, then writes
`docs/results.md` (tables) and `docs/img/*.png` (plots):

  (a) at an aggressive learning rate, vanilla Muon's max logit keeps growing while MuonClip holds
      it near tau (and the max logit recomputed after each clip is at most tau);
  (b) MuonClip's loss is no worse than Muon's;
  (c) at the same tokens, Muon / MuonClip reach a lower loss than AdamW, each with its learning rate
      picked from the same small grid.

    python benchmarks/muonclip_study.py [--steps 200] [--out runs/study] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

from k2_train import PretrainConfig, run_training
from k2_train.metrics import read_metrics
from k2_train.plots import plot_runs
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


# Learning rates per optimizer, from one grid {3e-3, 1e-2, 3e-2}: AdamW at the lower two, Muon and
# MuonClip at the upper two (Muon's RMS-matched update wants a larger lr; on 2 CPU cores the
# full 3x3 grid takes too long, and these are the pairs around each optimizer's best).
RUNS = (
    ("adamw", 3e-3),
    ("adamw", 1e-2),
    ("muon", 1e-2),
    ("muon", 3e-2),
    ("muonclip", 1e-2),
    ("muonclip", 3e-2),
)


def grid(quick: bool) -> list[tuple[str, dict]]:
    """(label, overrides) per run. For Muon/MuonClip `lr` is Muon's; the embeddings, head and 1-D
    parameters use AdamW at `adamw_lr` (3e-3) in all of them."""
    if quick:
        return [
            ("adamw lr=3e-3", {"optimizer": "adamw", "lr": 3e-3}),
            ("muon lr=3e-2", {"optimizer": "muon", "lr": 3e-2}),
            ("muonclip lr=3e-2", {"optimizer": "muonclip", "lr": 3e-2}),
        ]
    return [(f"{opt} lr={lr:.0e}".replace("e-0", "e-"), {"optimizer": opt, "lr": lr}) for opt, lr in RUNS]


def summarise(label: str, rows: list[dict], tau: float, tail: int) -> dict:
    last = rows[-tail:]
    after = [r["max_logit_after_clip"] for r in rows if "max_logit_after_clip" in r]
    vals = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    return {
        "run": label,
        "tail_loss": statistics.fmean(r["loss"] for r in last),
        "val_loss": vals[-1] if vals else float("nan"),
        "peak_max_logit": max(r["max_logit"] for r in rows),
        "last_max_logit": rows[-1]["max_logit"],
        "peak_after_clip": max(after) if after else float("nan"),
        "clipped_steps": sum(1 for r in rows if r["clipped_heads"] > 0),
        "fraction_ever_clipped": rows[-1].get("fraction_heads_ever_clipped", 0.0),
        "tau": tau,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--tau", type=float, default=30.0, help="QK-Clip threshold (the paper's small ablation used 30)"
    )
    ap.add_argument("--max-corpus-mb", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / f"study-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="three runs instead of the full grid")
    ap.add_argument(
        "--replot", action="store_true", help="no training: re-read the runs in --out, rewrite docs"
    )
    args = ap.parse_args()
    console = Console()
    tail = max(1, min(50, args.steps // 4))

    results, curves = [], []
    for label, overrides in grid(args.quick):
        cfg = PretrainConfig.flat(
            steps=args.steps,
            batch=args.batch,
            seq_len=args.seq_len,
            tau=args.tau,
            max_corpus_mb=args.max_corpus_mb,
            eval_every=max(1, args.steps // 4),
            save_every=0,
            warmup_steps=max(1, args.steps // 20),
            log_post_clip_logit=True,
            threads=args.threads,
            out=str(args.out / label.replace(" ", "_").replace("=", "")),
            **overrides,
        )
        t0 = time.perf_counter()
        if not args.replot:
            console.print(f"[bold]{label}[/bold] ...")
            run_training(cfg, log=lambda _msg: None)
        rows = read_metrics(Path(cfg.out) / "metrics.jsonl")
        s = summarise(label, rows, args.tau, tail)
        s["seconds"] = time.perf_counter() - t0
        results.append(s)
        curves.append((label, rows))
        console.print(
            f"  tail loss {s['tail_loss']:.3f}  val {s['val_loss']:.3f}  peak max logit {s['peak_max_logit']:.1f}  "
            f"({s['seconds']:.0f} s)"
        )

    img = args.docs / "img"
    plot_runs(curves, img, tau=args.tau, prefix="study_all_")
    plot_runs([c for c in curves if not c[0].startswith("adamw")], img, tau=args.tau, prefix="study_muon_")
    (args.out / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))

    table = Table(
        title=f"tiny K2, {args.steps} steps x {args.batch} x {args.seq_len} tokens, tau={args.tau:g}"
    )
    for col in (
        "run",
        f"last-{tail} loss",
        "val loss",
        "peak max logit",
        "last max logit",
        "peak after clip",
        "steps with a clip",
        "heads ever clipped",
    ):
        table.add_column(col, justify="right")
    for s in results:
        table.add_row(
            s["run"],
            f"{s['tail_loss']:.3f}",
            f"{s['val_loss']:.3f}",
            f"{s['peak_max_logit']:.1f}",
            f"{s['last_max_logit']:.1f}",
            f"{s['peak_after_clip']:.1f}",
            str(s["clipped_steps"]),
            f"{100 * s['fraction_ever_clipped']:.0f}%",
        )
    console.print(table)
    write_results_md(args, results, tail)
    console.print(f"wrote {args.docs / 'results.md'} and plots in {img}; runs in {args.out}")


def write_results_md(args: argparse.Namespace, results: list[dict], tail: int) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    lines = [
        (
            f"| run | last-{tail}-step mean loss | final val loss | peak max logit (before clip) | last max logit | "
            "peak max logit after clip | steps with a clip | heads ever clipped |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in results:
        after = "-" if s["run"].startswith(("adamw", "muon ")) else f"{s['peak_after_clip']:.1f}"
        lines.append(
            f"| {s['run']} | {s['tail_loss']:.3f} | {s['val_loss']:.3f} | {s['peak_max_logit']:.1f} | "
            f"{s['last_max_logit']:.1f} | {after} | {s['clipped_steps']} | {100 * s['fraction_ever_clipped']:.0f}% |"
        )
    block = "\n".join(lines)
    md = args.docs / "results.md"
    header = (
        f"<!-- generated by benchmarks/muonclip_study.py; commit {commit}; {time.strftime('%Y-%m-%d')}; "
        f"{platform.processor() or platform.machine()} -->\n"
    )
    start, end = "<!-- study:begin -->", "<!-- study:end -->"
    body = (
        f"{start}\n{header}\n{block}\n\nCommand: `python benchmarks/muonclip_study.py --steps {args.steps} "
        f"--batch {args.batch} --seq-len {args.seq_len} --tau {args.tau:g}`\n{end}"
    )
    text = md.read_text() if md.exists() else "# Results\n\n" + body + "\n"
    if start in text and end in text:
        text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)


if __name__ == "__main__":
    main()
