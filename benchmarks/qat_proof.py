"""INT4 at small scale: full precision, post-training quantisation (PTQ) and quantisation-aware
training (QAT) of the routed experts, per seed, on the RL proof's 2-digit addition task.

    .venv/bin/python benchmarks/qat_proof.py --seeds 0 1 2 3 --steps 300 --out runs/qat-proof [--bits 4|3|2]
        [--n-sft 2400] [--model-overrides JSON]

The model: the tiny preset with routed experts only (no shared expert, no dense first layer), so
that the experts hold the MLP capacity. Per seed: `k2 sft` on the worked additions in full
precision (FP; --n-sft worked additions, by default 2,400: 300 steps of 8 see each once), and
the same run with `--qat int4` (QAT: the experts' forward sees the INT4
weights, gradients straight through); PTQ = `k2 export --quantize int4` of the FP run, QAT's
deployed model = the same export of the QAT run. `--bits 3` / `2`: the same with `--qat int3` /
`int2` and the deployed experts rounded to that width in memory (no export format). Each of FP,
PTQ and QAT is scored by
  - eval loss: mean next-token loss on the assistant tokens of held-out worked additions
    (conversations the SFT never saw, rendered as k2 sft renders them);
  - greedy agreement with FP: over 32 held-out prompts, the share of the first --gen-tokens greedy
    tokens that match FP's before the first difference (FP scores 1 by definition);
  - held-out accuracy: greedy answers to 400 held-out additions, the math reward
    (`k2_rl.evaluate`, the ruler `k2 rl` uses).
Reruns skip finished runs (the FP runs are shared by every --bits). Prints the table (mean and
spread over seeds) and, for eval loss and accuracy, the PTQ gap paired by seed with the 95%
confidence interval of its mean (Student t over the per-seed gaps) and the spread of its per-seed
values, and the share QAT closes; writes OUT/qat_proof.json (OUT/qat_proof-intB.json for 3 or 2
bits) and a bar chart of both scores per seed beside it (.png). The bar (docs/model.md): the PTQ gap, paired by seed, exceeds the seed noise (its 95%
interval excludes zero), and QAT closes at least half of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_common import machine, run_k2
from rl_proof import spread

# The tiny preset with every MLP a routed-expert layer and no shared expert: the experts hold the
# model's MLP capacity, so quantising them costs something measurable (with the preset's shared
# expert and dense first layer, INT4 experts moved the loss by 1e-4 of 0.114: nothing to close).
EXPERTS_ONLY = {"n_shared_experts": 0, "first_k_dense_replace": 0}


def sft(run: Path, data: Path, steps: int, seed: int, overrides: dict, *extra: str) -> None:
    if (run / "state" / "latest").is_file():  # finished: reused, if it trained on this data
        trained_on = json.loads((run / "config.json").read_text()).get("data")
        if Path(trained_on).resolve() != data.resolve():
            sys.exit(
                f"qat_proof: {run} trained on {trained_on}, not {data}: another --n-sft needs another --out"
            )
        return
    run_k2(
        "sft", "--data", str(data), "--seq-len", "256", "--batch", "8", "--steps", str(steps),
        "--eval-every", "0", "--save-every", str(steps), "--seed", str(seed),
        "--model-overrides", json.dumps(overrides), *extra, "--out", str(run), "--json",
    )  # fmt: skip


def export(run: Path, out: Path, quantize: str) -> Path:
    if not (out / "config.json").is_file():
        run_k2("export", str(run), "--out", str(out), "--quantize", quantize, "--force")
    return out


def fake_quantized(src: Path, out: Path, bits: int, group_size: int = 32) -> Path:
    """An HF dir of `src` with its routed experts replaced by their `bits`-bit values (the weights a
    deployment at that width would run; 3 and 2 bits have no export format, so they are stored as
    the dequantised values)."""
    if (out / "config.json").is_file():
        return out
    from k2_data import load_tokenizer
    from k2_model import K2ForCausalLM
    from k2_model.int4 import fake_quantize_int

    model = K2ForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():
            for name in ("gate_proj", "up_proj", "down_proj"):
                w = getattr(m, name, None)
                if isinstance(w, torch.nn.Parameter) and w.dim() == 3:  # stacked routed experts
                    w.copy_(fake_quantize_int(w, bits, group_size))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a half-written one from an interrupted run
    model.save_pretrained(str(tmp))
    load_tokenizer(src).save(tmp)
    tmp.rename(out)
    return out


@torch.no_grad()
def eval_loss(model, tok, conversations: list[dict]) -> float:
    """Mean cross-entropy over the trained (assistant) tokens of `conversations`."""
    from k2_data.chat import render_ids_with_mask

    total, n = 0.0, 0
    for conv in conversations:
        ids, mask = render_ids_with_mask(tok, conv["messages"], conv.get("tools"))
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
        target = torch.tensor(ids[1:])
        m = torch.tensor(mask[1:], dtype=torch.bool)
        total += float(-logp[torch.arange(len(target)), target][m].sum())
        n += int(m.sum())
    return total / max(n, 1)


@torch.no_grad()
def greedy(model, prompt: list[int], tokens: int) -> list[int]:
    x, out = torch.tensor([prompt]), []
    for _ in range(tokens):
        nxt = int(model(x).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], 1)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of tokens before the first difference."""
    shares = []
    for x, y in zip(a, b):
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
        shares.append(same / len(x))
    return statistics.mean(shares)


# Student t, two-sided 95%, by degrees of freedom (a table: scipy is not a dependency); between
# entries the next smaller df's value is used, which only widens the interval
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
       10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}  # fmt: skip


def ci95(values: list[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of `values` (inf for one value)."""
    n = len(values)
    if n < 2:
        return float("inf")
    t = T95[max(df for df in T95 if df <= n - 1)]
    return t * statistics.stdev(values) / n**0.5


def ptq_gap(results: dict[str, dict[str, list[float]]], metric: str, worse: float) -> dict:
    """The PTQ gap of `metric`, paired by seed: PTQ - FP of the same run in the worse direction
    (`worse` 1 for a loss, -1 for an accuracy), its mean against the 95% interval of that mean and
    the spread of the per-seed gaps (the FP levels move much more between seeds than the gap
    does), and the share QAT closes, (PTQ - QAT) / (PTQ - FP) in the worse direction, by the means
    (1: QAT as good as FP; None when there is no positive gap)."""
    per_seed = [worse * (p - f) for p, f in zip(results["PTQ"][metric], results["FP"][metric])]
    gap, noise = statistics.mean(per_seed), ci95(per_seed)
    mean = {k: statistics.mean(v[metric]) for k, v in results.items()}
    return {
        "gap_per_seed": per_seed,
        "gap": gap,
        "ci95": noise if noise != float("inf") else None,  # JSON has no Infinity
        "spread": spread(per_seed),
        "beyond_noise": gap > noise,
        "closed": worse * (mean["PTQ"] - mean["QAT"]) / gap if gap > 0 else None,
    }


def plot(results: dict, setup: dict, path: Path) -> Path:
    """Per seed, FP / PTQ / QAT side by side: held-out accuracy and eval loss (the two scores the
    gap is judged on), the means as the last group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [str(s) for s in setup["seeds"]] + ["mean"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for ax, (metric, title) in zip(
        axes, (("accuracy", "held-out accuracy (greedy)"), ("eval_loss", "eval loss"))
    ):
        for i, (name, color) in enumerate((("FP", "tab:gray"), ("PTQ", "tab:red"), ("QAT", "tab:blue"))):
            vals = results[name][metric] + [statistics.mean(results[name][metric])]
            ax.bar([x + (i - 1) * width for x in range(len(seeds))], vals, width, color=color, label=name)
        ax.set_xticks(range(len(seeds)), [f"seed {s}" if s != "mean" else s for s in seeds])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        if metric == "accuracy":
            lo = min(min(v["accuracy"]) for v in results.values())
            ax.set_ylim(max(0.0, lo - 0.1), 1.0)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"{setup['bits']}-bit routed experts (groups of 32), {setup['steps']} SFT steps on {setup['n_sft']} "
        f"additions: FP, post-training quantised (PTQ), QAT\n{setup['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(results: dict, setup: dict, out: Path) -> None:
    """Print the table and the PTQ gaps; write them with the per-seed results and the `setup` (the
    machine, seeds, steps, bits and model the runs had) to `out`."""
    seeds = setup["seeds"]
    print(
        f"\nmachine: {setup['machine']}; seeds {seeds}, {setup['steps']} SFT steps on {setup['n_sft']} "
        f"additions, {setup['bits']}-bit routed experts, groups of 32; model: tiny preset + "
        f"{json.dumps(setup['model_overrides'])}\n"
    )
    print("| model | eval loss | greedy agreement with FP | held-out accuracy |")
    print("|---|---|---|---|")
    for name, m in results.items():
        cells = [f"{statistics.mean(v):.4f} (spread {spread(v):.4f})" for v in m.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    summary = {}
    for metric, worse in (("eval_loss", 1.0), ("accuracy", -1.0)):
        summary[metric] = g = ptq_gap(results, metric, worse)
        per = ", ".join(f"{v:+.4f}" for v in g["gap_per_seed"])
        noise = g["ci95"] if g["ci95"] is not None else float("inf")
        where = f"per seed {per}; 95% interval +-{noise:.4f}, spread {g['spread']:.4f}"
        if g["beyond_noise"]:
            print(
                f"\nPTQ gap ({metric}, worse by) {g['gap']:+.4f} ({where}); QAT closes {g['closed']:.0%} of it"
            )
        else:
            print(
                f"\nPTQ gap ({metric}, worse by) {g['gap']:+.4f} ({where}, {len(seeds)} seed(s)): "
                "no gap beyond the seed noise to close at this width"
            )
    out.write_text(json.dumps({**setup, "results": results, **summary}, indent=2))
    print(f"\nwrote {out} and {plot(results, setup, out.with_suffix('.png'))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300, help="SFT steps of both the FP and the QAT run")
    ap.add_argument("--out", type=Path, default=Path("runs/qat-proof"))
    ap.add_argument("--heldout", type=int, default=400, help="held-out additions for the accuracy")
    ap.add_argument(
        "--n-sft",
        type=int,
        default=2400,
        help="worked additions the SFT trains on (2400: one pass at the default steps and batch, no "
        "overfitting; 256 overfits and makes accuracy seed-dependent; runs of another count need "
        "another --out, k2 sft refuses to resume a run on other data)",
    )
    ap.add_argument(
        "--loss-conversations", type=int, default=64, help="held-out worked additions for the loss"
    )
    ap.add_argument(
        "--model-overrides",
        type=json.loads,
        default=EXPERTS_ONLY,
        help="K2Config fields over the tiny preset, as JSON (default: routed experts only, no shared expert)",
    )
    ap.add_argument(
        "--bits",
        type=int,
        choices=[4, 3, 2],
        default=4,
        help="routed-expert bit width, groups of 32: 4 is INT4 (exported as compressed-tensors); 3 and 2 "
        "are coarser schemes for when INT4 costs nothing measurable (QAT with --qat int3 / int2, the "
        "deployed weights stored dequantised)",
    )
    ap.add_argument("--gen-prompts", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument(
        "--report-only", action="store_true", help="the table and the gaps from OUT's stored results, no runs"
    )
    args = ap.parse_args()
    result_file = args.out / ("qat_proof.json" if args.bits == 4 else f"qat_proof-int{args.bits}.json")
    setup = {
        "machine": machine(load=True), "seeds": args.seeds, "steps": args.steps, "bits": args.bits,
        "n_sft": args.n_sft, "model_overrides": args.model_overrides,
    }  # fmt: skip
    if args.report_only:  # what the stored runs had (older files lack the setup: this call's flags)
        stored = json.loads(result_file.read_text())
        report(stored["results"], {k: stored.get(k, v) for k, v in setup.items()}, result_file)
        return
    from k2_data import load_tokenizer
    from k2_data.chat import render_ids
    from k2_rl.evaluate import evaluate_policy, load_policy
    from k2_rl.tasks import read_tasks

    data = args.out / ("data" if args.n_sft == 256 else f"data-n{args.n_sft}")
    if not (data / "sft.jsonl").is_file():
        subprocess.run(
            [sys.executable, "-m", "k2_rl.tasks", "--out", str(data), "--digits", "2", "--n-sft", str(args.n_sft),
             "--n-heldout", str(args.heldout)], check=True, capture_output=True,
        )  # fmt: skip
    held_sft = args.out / "heldout-sft"  # worked additions of another seed: the loss's conversations
    if not (held_sft / "sft.jsonl").is_file():
        subprocess.run(
            [sys.executable, "-m", "k2_rl.tasks", "--out", str(held_sft), "--digits", "2", "--n-sft",
             str(args.loss_conversations), "--n-heldout", "1", "--seed", "1"], check=True, capture_output=True,
        )  # fmt: skip
    loss_convs = [json.loads(line) for line in (held_sft / "sft.jsonl").read_text().splitlines()]
    train_answers = {json.dumps(json.loads(line)["messages"][:-1]) for line in (data / "sft.jsonl").open()}
    loss_convs = [c for c in loss_convs if json.dumps(c["messages"][:-1]) not in train_answers]
    tasks = read_tasks(data / "heldout.jsonl", "math")[: args.gen_prompts]

    results: dict[str, dict[str, list[float]]] = {k: {} for k in ("FP", "PTQ", "QAT")}
    for seed in args.seeds:
        root = args.out / f"seed{seed}"
        sft(root / "fp", data / "sft.jsonl", args.steps, seed, args.model_overrides)
        scheme = f"int{args.bits}"
        qat_run = root / ("qat" if args.bits == 4 else f"qat-{scheme}")
        sft(qat_run, data / "sft.jsonl", args.steps, seed, args.model_overrides, "--qat", scheme)
        fp_dir = export(root / "fp", root / "fp-hf", "none")
        if args.bits == 4:
            dirs = {
                "FP": fp_dir,
                "PTQ": export(root / "fp", root / "ptq-int4", "int4"),
                "QAT": export(qat_run, root / "qat-int4", "int4"),
            }
        else:
            dirs = {
                "FP": fp_dir,
                "PTQ": fake_quantized(fp_dir, root / f"ptq-{scheme}", args.bits),
                "QAT": fake_quantized(
                    export(qat_run, root / f"{qat_run.name}-hf", "none"),
                    root / f"{qat_run.name}-deployed",
                    args.bits,
                ),
            }
        tok = load_tokenizer(dirs["FP"])
        prompts = [render_ids(tok, t["messages"], add_generation_prompt=True) for t in tasks]
        fp_model = load_policy(dirs["FP"])
        fp_gen = [greedy(fp_model, p, args.gen_tokens) for p in prompts]
        for name, d in dirs.items():
            model = fp_model if name == "FP" else load_policy(d)
            gen = fp_gen if name == "FP" else [greedy(model, p, args.gen_tokens) for p in prompts]
            acc = evaluate_policy(d, data / "heldout.jsonl", max_response_tokens=48)["heldout_accuracy"]
            row = {
                "eval_loss": eval_loss(model, tok, loss_convs),
                "agreement": agreement(gen, fp_gen),
                "accuracy": acc,
            }
            for k, v in row.items():
                results[name].setdefault(k, []).append(v)
            print(f"seed {seed} {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)

    report(results, setup, result_file)


if __name__ == "__main__":
    main()
