"""Agentic RL at small scale: RL on a tool environment against SFT continued, on held-out tasks
that cannot be gamed.

0. With --base-steps N, a base model first: `k2 pretrain` of the student's shape for N steps on
   this Python's standard library source mixed with synthetic copy documents (`--copy-share` of
   the tokens; quoted random words of the tokenizer, either repeated as a whole or each twice in a
   row), which train every word's embedding and unembedding, held-out ones included, and reward
   copying; its copy probe (greedy accuracy on the copies, both kinds, training and held-out
   pools) is reported. Without it the student starts from random weights (`--model-overrides`).
1. Data (`python -m k2_rl.envs.expert --env ENV`): expert episodes for SFT, RL tasks and
   in-distribution tasks from the training word pool, and held-out tasks whose keys and values
   come from the hash-disjoint held-out pool, in three columns (`split`): `values` (the trained
   kinds of task), `compositions` (calls combined in ways no training task shows) and `tools`
   (the trained kinds behind tool names never trained on; reported, no target).
2. Per seed: `k2 sft` a small K2 on the expert episodes with --repeat-convs "repeat these words"
   conversations over the whole vocabulary mixed in, at a tenth of k2 sft's default learning rates
   (the student: at the default rates SFT replaces the base's copy of any word by a copy of the
   training pool's words only); from it (a) `k2 rl --env ENV` for --iterations and (b) the
   baseline: `k2 sft --init` the student, continued on the same data for as many optimizer steps
   as the RL run took, at the RL run's learning rates (constant).
3. One ruler for all (`k2_rl.evaluate.evaluate_env_policy`, what `k2 rl --env` logs as
   `heldout_accuracy`): greedy episodes, strict success. The scripted policies `nothing` and
   `frequent-call` are scored on the same held-out tasks: what gaming them gives.

The target: RL's held-out strict success at least 10 points above the baseline's, the gap more
than twice its spread over the seeds.

    python benchmarks/agentic_rl_proof.py [--seeds 0 1 2] [--iterations 40] [--sft-steps 600]
        [--base-steps 0 [--copy-share 0.5] | --base RUN] [--out runs/agentic-rl-proof] [--sft-args "..."]
        [--rl-args "..."] [--data-args "..."]

Reruns skip finished runs and continue interrupted ones (`--resume`), so seeds can run in the
background over several sittings (one `--seeds N` per process). Writes OUT/results.json,
OUT/agentic_rl_proof.png (reward, success, turns, failed calls, continuity and held-out success
per iteration) and prints the markdown tables for docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench_common import machine
from rl_proof import config, rows, save_figure, spread, train

ROOT = Path(__file__).resolve().parents[1]
MODEL = {
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 64,
    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "intermediate_size": 256,
    "moe_intermediate_size": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
}  # fmt: skip
DATA_DEFAULTS = "--sft 2000 --requests 4 --tasks 512 --heldout 150"
SFT_DEFAULTS = "--seq-len 1088 --batch 8 --lr 1e-3 --adamw-lr 3e-4 --eval-every 0 --save-every 250"
RL_DEFAULTS = (
    "--prompts-per-iteration 8 --samples-per-prompt 8 --max-response-tokens 48 --max-turns 4 "
    "--eval-every 10 --eval-prompts 150 --lr 1e-3 --adamw-lr 2e-4"
)
SPLITS = ("values", "compositions", "tools")
BASE_ARGS = "--optimizer muonclip --lr 0.02 --tau 30 --seq-len 512 --batch 16 --max-corpus-mb 16 --eval-every 0 --save-every 250"


def copy_vocabulary() -> list[str]:
    """Every alphabetic token of 3-10 letters of the default tokenizer (3,897 words; both kvstore
    pools are among them): the words the copy documents and the repeat conversations draw from."""
    import re

    from k2_data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    vocab = sorted({tok.decode([i]).strip() for i in range(tok.num_base_tokens)} - {""})
    return [w for w in vocab if re.fullmatch(r"[A-Za-z]{3,10}", w)]


def repeat_conversations(sft: Path, n: int, seed: int = 0) -> Path:
    """`sft` (expert episodes) with `n` conversations mixed in that ask to repeat 2-8 quoted words
    drawn from the whole vocabulary (`copy_vocabulary`), answered with the same words: copying in the
    chat format, over every word rather than the training pool only. Written once, beside `sft`."""
    if n <= 0:
        return sft
    path = sft.with_name(f"{sft.stem}-repeat{n}.jsonl")
    if path.is_file():
        return path
    import random

    episodes = sft.read_text().splitlines()
    tools = json.loads(episodes[0])["tools"]
    vocab, rng = copy_vocabulary(), random.Random(seed)
    lines = list(episodes)
    for _ in range(n):
        words = " ".join(f'"{rng.choice(vocab)}"' for _ in range(rng.randint(2, 8)))
        messages = [
            {"role": "user", "content": f"Repeat these words: {words}"},
            {"role": "assistant", "content": words},
        ]
        lines.append(json.dumps({"messages": messages, "tools": tools}))
    rng.shuffle(lines)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def copy_corpus(path: Path, n_docs: int = 40_000, seed: int = 0) -> Path:
    """Synthetic copy documents over 6-30 random words of the default tokenizer (every alphabetic
    token of 3-10 letters), each in double quotes as tool-call arguments and the tasks' requests write
    them (`"poll"` is the bare token `poll`, while ` poll` would be ` po` + `ll`): half of them the
    words then the same words again, half every word twice in a row. Written once (atomically)."""
    if path.is_file():
        return path
    import random

    vocab = copy_vocabulary()
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(n_docs):
            ws = [f'"{rng.choice(vocab)}"' for _ in range(rng.randint(6, 30))]
            if i % 2:  # every word twice in a row: the copy of a token a fixed distance back
                text = " ".join(f"{w} {w}" for w in ws) + "\n"
            else:  # the whole sequence again: copy what followed the previous occurrence (induction)
                text = f"{' '.join(ws)}\n{' '.join(ws)}\n"
            f.write(json.dumps({"text": text}) + "\n")
    tmp.replace(path)
    return path


def copy_probe(init: str | Path, n_seqs: int = 8, length: int = 30) -> dict[str, dict[str, float]]:
    """Greedy accuracy on the copies in the two kinds of copy document, per kvstore word pool:
    `sequence` (`length` quoted random words of the pool, a newline, the same words again: the words
    of the second half) and `pairs` (every word twice in a row: the second of each pair). Only the
    word tokens count, not the quotes: what the model copies without any task format (0 without a
    copy circuit)."""
    import random

    import torch
    from k2_data.tokenizer import load_tokenizer
    from k2_rl.envs.kvstore import pool
    from k2_rl.evaluate import load_policy

    tok, model = load_tokenizer(), load_policy(init)
    rng, out = random.Random(0), {"sequence": {}, "pairs": {}}
    for name in ("train", "heldout"):
        for kind in out:
            hit = n = 0
            for _ in range(n_seqs):
                ws = rng.sample(pool(name), length)
                if kind == "sequence":
                    words = ws + ws
                    half = " ".join(f'"{w}"' for w in ws)
                    text = f"{half}\n{half}\n"
                else:
                    words = [w for w in ws for _ in (0, 1)]
                    text = " ".join(f'"{w}"' for w in words) + "\n"
                ids = tok.encode(text)
                with torch.no_grad():
                    pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
                # pool words are single tokens and no quote token is one, so the word positions in
                # `ids` are the words of `text` in order
                vocab = {tok.encode(w)[0] for w in ws}
                at = [i for i, t in enumerate(ids) if t in vocab]
                assert len(at) == len(words), (len(at), len(words))
                copies = at[length:] if kind == "sequence" else at[1::2]
                hit += sum(pred[i - 1] == ids[i] for i in copies)
                n += len(copies)
            out[kind][name] = hit / n
    return out


def data(out: Path, env: str, data_args: str, n_indist: int = 150) -> Path:
    """The expert episodes and task files, plus OUT/data/indist.jsonl: fresh training-pool tasks
    (the trained distribution, none of them an RL task) for the in-distribution column."""
    import subprocess

    d = out / "data"
    if not (d / "indist.jsonl").is_file():
        argv = [sys.executable, "-m", "k2_rl.envs.expert", "--env", env, "--out", str(d), *data_args.split()]
        subprocess.run(argv, check=True)
        from k2_rl.envs import get_env

        maker = get_env(env)
        try:
            tasks = maker.tasks(n_indist, 7_000_007)
        finally:
            maker.close()
        rl = {
            json.dumps(t["messages"]) for t in map(json.loads, (d / "tasks.jsonl").read_text().splitlines())
        }
        fresh = [t for t in tasks if json.dumps(t["messages"]) not in rl]
        tmp = d / "indist.jsonl.tmp"
        tmp.write_text("".join(json.dumps(t) + "\n" for t in fresh))
        tmp.replace(d / "indist.jsonl")
    return d


def evaluate(init: str | Path, env: str, tasks: Path, rl_cfg: dict, cache: Path) -> dict:
    """Greedy episodes of `init` on `tasks` (read back from `cache` when measured before)."""
    if cache.is_file():
        return json.loads(cache.read_text())
    from k2_rl.evaluate import evaluate_env_policy

    r = evaluate_env_policy(
        init, env, tasks, max_turns=rl_cfg["max_turns"],
        max_response_tokens=rl_cfg["max_response_tokens"],
        max_episode_tokens=rl_cfg["max_episode_tokens"],
    )  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(r, indent=1))
    return r


def argument_probe(init: str | Path, records: list[dict]) -> dict[str, float]:
    """Teacher-forced: the share of argument-value tokens (the words inside tool-call arguments,
    not the field names) that are the model's argmax given the right prefix, and their mean
    negative log-likelihood; what greedy decoding of the calls needs, per token."""
    import torch
    from k2_data.chat import render_ids
    from k2_data.chat.markers import ARGUMENT_BEGIN, CALL_END
    from k2_rl.evaluate import load_policy
    from k2_rl.loop import load_tokenizer_for

    tok, model = load_tokenizer_for(str(init)), load_policy(init)
    begin, end = tok.token_to_id(ARGUMENT_BEGIN), tok.token_to_id(CALL_END)
    hit, nll = [], []
    for r in records:
        ids = render_ids(tok, r["messages"], r["tools"])
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        inside = False
        for i in range(1, len(ids)):
            inside = (inside or ids[i] == begin) and ids[i] != end
            word = tok.decode([ids[i]])
            if inside and ids[i] != begin and word.isalpha() and word not in ("key", "value"):
                hit.append(int(logp[i - 1].argmax()) == ids[i])
                nll.append(-float(logp[i - 1, ids[i]]))
    return {"accuracy": sum(hit) / max(1, len(hit)), "nll": sum(nll) / max(1, len(nll)), "tokens": len(hit)}


def probe(init: str, env: str, n: int = 24) -> dict:
    """The copy probe and the argument probe of `init` on expert conversations of fresh training-pool
    tasks and of held-out `values` tasks."""
    from k2_rl.envs import get_env
    from k2_rl.envs.expert import expert_episode
    from k2_rl.envs.kvstore import heldout_tasks

    maker = get_env(env)
    try:
        train = [expert_episode(maker, t) for t in maker.tasks(n, 9_000_009)]
        held = [expert_episode(maker, t) for t in heldout_tasks(3 * n, 9_000_009) if t["split"] == "values"]
    finally:
        maker.close()
    return {
        "copy_probe": copy_probe(init),
        "arguments_train": argument_probe(init, [r for r in train if r]),
        "arguments_heldout": argument_probe(init, [r for r in held if r]),
    }


def _series(run: Path, key: str) -> list[tuple[int, float]]:
    return [(r["iteration"], r[key]) for r in rows(run) if r.get(key) is not None and "iteration" in r]


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to `window - 1` before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("episode_reward_mean", "episode reward (mean, sampled)"),
        ("success_rate", "strict success (sampled episodes)"),
        ("turns_mean", "assistant turns per episode"),
        ("tool_errors_mean", "failed tool calls per episode"),
        ("continuity_turn2", "continuity: equal re-render at turn 2"),
        ("heldout_accuracy", "held-out strict success (greedy)"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    window = 10  # per-iteration values of 64 episodes are noisy: a trailing mean shows the trend
    for n, (seed, per) in enumerate(results["seeds"].items()):
        run = Path(per["rl_run"])
        color = f"C{n % 10}"
        for ax, (key, title) in zip(axes.flat, panels):
            pts = _series(run, key)
            if pts and key == "heldout_accuracy":  # evaluated every few iterations: each point
                ax.plot(*zip(*pts), color=color, marker=".", label=f"RL seed {seed}")
            elif pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=color, lw=0.6, alpha=0.25)
                ax.plot(xs, trailing_mean(ys, window), color=color, lw=1.6,
                        label=f"seed {seed} ({window}-iteration mean)")  # fmt: skip
            ax.set_title(title, fontsize=10)
        axes[1][2].axhline(per["baseline"]["heldout_accuracy"], color=color, ls="--", lw=0.9)
    axes[0][0].legend(fontsize=8)
    axes[1][2].plot([], [], color="gray", ls="--", label="SFT continued (its seed's color)")
    for r in results["scripted"].values():
        axes[1][2].axhline(r["heldout_accuracy"], color="black", lw=0.6, alpha=0.6)
    axes[1][2].plot([], [], color="black", lw=0.6, label="scripted: nothing / frequent call")
    title = f"k2 rl --env {results['env']} against SFT continued: {results['machine']}"
    return save_figure(fig, axes[1][2], title, out / "agentic_rl_proof.png", title_size=11)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--env", default="kvstore", help="kvstore (simulator) or kvstore-mcp (the live server)")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "agentic-rl-proof")
    ap.add_argument("--model-overrides", default=json.dumps(MODEL), help="the student's K2 shape (JSON)")
    ap.add_argument(
        "--base", default=None, help="a pretrained run (k2 pretrain --out DIR) the student's SFT starts from"
    )
    ap.add_argument(
        "--base-steps",
        type=int,
        default=0,
        help="pretrain OUT/base for N steps first (step 0 above); 0: none",
    )
    ap.add_argument("--base-args", default=BASE_ARGS, help=f"flags of k2 pretrain for the base ({BASE_ARGS})")
    ap.add_argument("--copy-docs", type=int, default=40_000, help="synthetic copy documents for the base")
    ap.add_argument(
        "--copy-share",
        type=float,
        default=0.5,
        help="the copy documents' share of the base's tokens (rest: stdlib)",
    )
    ap.add_argument(
        "--repeat-convs",
        type=int,
        default=2000,
        help="'repeat these words' conversations over the whole vocabulary mixed into both SFT runs' data",
    )
    ap.add_argument(
        "--indist", type=int, default=150, help="in-distribution tasks (training pool, not RL tasks)"
    )
    ap.add_argument(
        "--data-args", default=DATA_DEFAULTS, help=f"python -m k2_rl.envs.expert flags ({DATA_DEFAULTS})"
    )
    ap.add_argument("--sft-args", default=SFT_DEFAULTS, help=f"flags of both k2 sft runs ({SFT_DEFAULTS})")
    ap.add_argument("--rl-args", default=RL_DEFAULTS, help=f"flags of k2 rl ({RL_DEFAULTS})")
    ap.add_argument("--report-only", action="store_true", help="tables and plots from the finished seeds")
    ap.add_argument(
        "--probe", metavar="RUN", help="only print the copy and argument probes of RUN (a run or a state dir)"
    )
    args = ap.parse_args()
    if not 0 < args.copy_share <= 1:
        ap.error(f"--copy-share must be in (0, 1], got {args.copy_share}")
    if args.probe:
        print(json.dumps(probe(args.probe, args.env), indent=1))
        return 0

    out = args.out
    d = data(out, args.env, args.data_args, args.indist)
    base_probe = None
    if args.base_steps and not args.base:
        args.base = str(out / "base")
        if not args.report_only:
            copy = copy_corpus(d / "copy-quoted.jsonl", args.copy_docs)  # not the older unquoted form
            share = args.copy_share
            mix = str(copy) if share >= 1 else f"stdlib:{1 - share:g},{copy}:{share:g}"
            train(Path(args.base), "step", args.base_steps, "pretrain", "--data", mix, "--steps", str(args.base_steps),
                  "--model-overrides", args.model_overrides, *args.base_args.split())  # fmt: skip
    if args.base:
        step = max((r["step"] for r in rows(Path(args.base)) if r.get("step") is not None), default=0)
        probe_file = Path(args.base) / f"copy-probe-step{step}.json"
        if not probe_file.is_file():
            probe_file.write_text(json.dumps(copy_probe(args.base)))
        base_probe = json.loads(probe_file.read_text())
        print(f"base {args.base}: copy probe {base_probe}", flush=True)
    results: dict = {
        "machine": machine(), "env": args.env, "iterations": args.iterations, "sft_steps": args.sft_steps,
        "data_args": args.data_args, "repeat_convs": args.repeat_convs, "sft_args": args.sft_args,
        "rl_args": args.rl_args,
        "model_overrides": json.loads(args.model_overrides), "base": args.base, "base_steps": args.base_steps,
        "base_copy_probe": base_probe, "seeds": {}, "scripted": {},
    }  # fmt: skip
    sft_data = repeat_conversations(d / "sft.jsonl", args.repeat_convs)
    for seed in args.seeds:
        t0 = time.perf_counter()
        s = ["--seed", str(seed)]
        sdir = out / f"seed{seed}"
        sft, rl = sdir / "sft", sdir / "rl"
        if not args.report_only:
            shape = ["--init", args.base] if args.base else ["--model-overrides", args.model_overrides]
            train(sft, "step", args.sft_steps, "sft", "--data", str(sft_data), "--steps", str(args.sft_steps),
                  *shape, *s, *args.sft_args.split())  # fmt: skip
            train(rl, "iteration", args.iterations, "rl", "--init", str(sft), "--env", args.env,
                  "--tasks", str(d / "tasks.jsonl"), "--heldout", str(d / "heldout.jsonl"),
                  "--iterations", str(args.iterations), *s, *args.rl_args.split())  # fmt: skip
        if not (rl / "config.json").is_file():
            continue
        rl_cfg = config(rl)
        steps = max(r["step"] for r in rows(rl) if r.get("step") is not None)
        base = sdir / f"sft-continued-{steps}"
        if not args.report_only:
            # the RL run's optimizer steps at its learning rates, constant (a fresh schedule would
            # warm up to the SFT peak and knock the converged student back)
            lrs = ["--lr", str(rl_cfg["lr"]), "--adamw-lr", str(rl_cfg["adamw_lr"]), "--warmup-steps", "0",
                   "--decay-fraction", "0"]  # fmt: skip
            train(base, "step", steps, "sft", "--init", str(sft), "--data", str(sft_data), "--steps", str(steps),
                  *s, *args.sft_args.split(), *lrs)  # fmt: skip
        if not (base / "state" / "latest").is_file():
            continue
        ev = sdir / "eval"
        per = {
            "rl_run": str(rl),
            "rl_steps": steps,
            "student": evaluate(sft, args.env, d / "heldout.jsonl", rl_cfg, ev / "student-heldout.json"),
            "rl": evaluate(rl, args.env, d / "heldout.jsonl", rl_cfg, ev / f"rl-{steps}-heldout.json"),
            "baseline": evaluate(base, args.env, d / "heldout.jsonl", rl_cfg, ev / f"sft-continued-{steps}-heldout.json"),
            "student_indist": evaluate(sft, args.env, d / "indist.jsonl", rl_cfg, ev / "student-indist.json"),
            "rl_indist": evaluate(rl, args.env, d / "indist.jsonl", rl_cfg, ev / f"rl-{steps}-indist.json"),
            "baseline_indist": evaluate(base, args.env, d / "indist.jsonl", rl_cfg, ev / f"sft-continued-{steps}-indist.json"),
            "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        results["seeds"][seed] = per
        print(f"seed {seed}: held-out student {per['student']['heldout_accuracy']:.1%}, SFT continued "
              f"{per['baseline']['heldout_accuracy']:.1%}, RL {per['rl']['heldout_accuracy']:.1%}", flush=True)  # fmt: skip
    rl_cfg = config(Path(next(iter(results["seeds"].values()))["rl_run"])) if results["seeds"] else None
    if rl_cfg is None:
        print("no finished seed yet", file=sys.stderr)
        return 1
    for name in ("nothing", "frequent-call"):
        results["scripted"][name] = evaluate(
            name, args.env, d / "heldout.jsonl", rl_cfg, out / "eval" / f"{name}.json"
        )

    per_seed = list(results["seeds"].values())
    gaps = [100 * (p["rl"]["heldout_accuracy"] - p["baseline"]["heldout_accuracy"]) for p in per_seed]
    gap = statistics.mean(gaps)
    results["summary"] = {
        "gap_points": gap, "gaps_points": gaps, "spread_points": spread(gaps),
        "target_met": len(per_seed) >= 3 and gap >= 10 and gap > 2 * spread(gaps),
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=2))
    png = plot(results, out)

    def cols(r: dict) -> str:
        return " | ".join(f"{r.get(f'heldout_accuracy_{s}', float('nan')):.1%}" for s in SPLITS)

    # the runs' own configs, not this invocation's flags (a --report-only call may pass other defaults)
    sft_cfg = config(Path(per_seed[0]["rl_run"]).parent / "sft")
    recipe = ", ".join(f"{k} {rl_cfg[k]}" for k in ("prompts_per_iteration", "samples_per_prompt",
                       "max_response_tokens", "max_turns", "lr", "adamw_lr"))  # fmt: skip
    print(f"\nmachine: {results['machine']}; --env {rl_cfg['env']}; SFT {sft_cfg['steps']} steps (lr "
          f"{sft_cfg['lr']}, adamw lr {sft_cfg['adamw_lr']}), then {rl_cfg['iterations']} RL iterations "
          f"({recipe}); greedy strict success\n")  # fmt: skip
    print(
        "| seed | policy | in-distribution | held-out (all) | values | compositions | tools (unseen names) |"
    )
    print("|---|---|---|---|---|---|---|")
    for seed, p in results["seeds"].items():
        for label, key in (("student (SFT)", "student"), (f"SFT continued ({p['rl_steps']} steps)", "baseline"),
                           (f"RL ({p['rl_steps']} iterations)", "rl")):  # fmt: skip
            ind = p["student_indist" if key == "student" else f"{key}_indist"]["heldout_accuracy"]
            print(f"| {seed} | {label} | {ind:.1%} | {p[key]['heldout_accuracy']:.1%} | {cols(p[key])} |")
    for name, r in results["scripted"].items():
        print(f"| - | scripted: {name} | | {r['heldout_accuracy']:.1%} | {cols(r)} |")
    sm = results["summary"]
    print(f"\nRL over SFT continued, held-out: {sm['gap_points']:+.1f} points (per seed "
          f"{', '.join(f'{g:+.1f}' for g in gaps)}; spread {sm['spread_points']:.1f}): "
          f"target {'met' if sm['target_met'] else 'NOT met'}")  # fmt: skip
    print(f"plots: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
