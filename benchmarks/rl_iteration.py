"""Seconds per RL iteration: `k2 rl` against TRL's `GRPOTrainer`, same model, prompts and budget.

    python -m k2_rl.tasks --out runs/bench-rl/data
    k2 sft --data runs/bench-rl/data/sft.jsonl --seq-len 256 --batch 16 --steps 60 \\
        --eval-every 0 --save-every 60 --threads 2 --out runs/bench-rl/sft
    python benchmarks/rl_iteration.py --init runs/bench-rl/sft --tasks runs/bench-rl/data/rl.jsonl \\
        [--prompts 16] [--samples 8] [--max-response-tokens 48] [--updates 1] [--warmup 1] \\
        [--iterations 3] [--threads 2] [--k2-optimizers adamw,muonclip] [--out runs/bench-rl/bench]

One iteration = P prompts x K samples (at most M new tokens each, temperature 1), their rewards,
U optimizer steps on all P*K responses, and (k2) the new weights pushed into the rollout engine.

* The model: `--init` (a `k2 sft`/`k2 pretrain` run, exported with `k2 export` into OUT/hf; or an
  HF-format dir used as it is; none: the tiny preset's random weights, for smoke tests). Both sides
  load that one directory: TRL through transformers (DeepseekV3ForCausalLM, fp32, its default
  attention and experts), `k2 rl --init OUT/hf` through k2-model.
* The prompts: the task file's prompts that `k2 rl` draws at each iteration
  (`k2_rl.loop.draw_prompts`, same seed), rendered in the Kimi chat format; TRL gets each rendered
  prompt as text (checked to tokenize back to exactly k2's ids) in that order (`shuffle_dataset=
  False`, each prompt repeated K times by TRL's sampler).
* The reward: the `--reward` entry of k2_rl's registry (default "math": math-verify on the
  `\\boxed{}` answer), wrapped as a TRL reward function (called on TRL's main thread, where
  math-verify's signal-based timeouts work); `k2 rl` runs it in its reward worker processes, with
  `--truncation-penalty 0` so both sides score with the very same function.
* fp32 on both sides (TRL `bf16=False`, the model loaded in float32; its default bf16 is emulated
  on this CPU), no gradient checkpointing (TRL's default is on; k2 does not use it), no vLLM
  (transformers' `generate`), no reference model (TRL `beta=0.0`, its default; k2's K1.5 loss has
  none). TRL's `loss_type` is its default "dapo" (clipped, token-level mean), `epsilon` 0.2,
  `scale_rewards` "group"; k2 runs its K1.5 objective. Optimizer: TRL AdamW (`adamw_torch`,
  betas 0.9/0.95, no weight decay, grad clip 1.0, constant lr), k2 `--optimizer adamw` with the
  same settings, and k2's default MuonClip as another row.
* Threads: each side runs in its own process with `torch.set_num_threads(T)`; k2's rollout
  worker (another process) gets T too, and its rewards `--reward-workers` processes.
* Phases. k2: `rollout_s`, `reward_s`, `train_s` (logp_old forward, the U steps, the KL
  estimate's forward) and `sync_s` (k2-ckpt `ParameterServer.update` into the rollout worker) of
  its metrics.jsonl, total = `iteration_s`. TRL: generation = `GRPOTrainer._generate` (prompt
  tokenization, `generate`, decoding), reward = `_calculate_rewards`, training = the rest of the
  iteration (wall time between the end of one iteration's last optimizer step and the next's:
  batching, advantages, forward/backward, the optimizer, its logging). TRL has no sync phase: the
  policy it generates with is the model it trains, in one process.
* The first `--warmup` iterations of each side are not counted; the table shows the mean of the
  next `--iterations`. Sides run one after another in this one run (a fresh process each).

Prints the machine, a markdown table and the ratios; writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generation_s", "reward_s", "training_s", "sync_s")
TRL_NAME = "TRL GRPOTrainer (AdamW)"


# ----------------------------------------------------------------------------- preparation


def prepare_model(init: str | None, out: Path, seed: int) -> Path:
    """The HF-format dir both sides load."""
    hf = out / "hf"
    if init is not None and (Path(init) / "config.json").is_file() and not (Path(init) / "state").is_dir():
        return Path(init)  # already HF format
    if init is not None:
        subprocess.run(
            [sys.executable, "-m", "k2_stack", "export", init, "--out", str(hf), "--force"], check=True
        )
        return hf
    import torch
    from k2_data import load_tokenizer
    from k2_model import K2Config, K2ForCausalLM

    torch.manual_seed(seed)
    model = K2ForCausalLM(K2Config.preset("tiny"))
    model.save_pretrained(str(hf))
    load_tokenizer().save(hf)
    return hf


def prepare_prompts(args: argparse.Namespace, hf: Path, out: Path) -> tuple[Path, Path]:
    """The task file both sides use and, per iteration, the prompts `k2 rl` will draw (for TRL)."""
    from k2_data import load_tokenizer
    from k2_data.chat import render_ids
    from k2_rl.loop import draw_prompts
    from k2_rl.tasks import read_tasks, write_addition_dataset
    from transformers import AutoTokenizer

    if args.tasks is None:
        write_addition_dataset(out / "data", n_sft=0, n_rl=500, n_heldout=1, seed=0)
        tasks_path = out / "data" / "rl.jsonl"
    else:
        tasks_path = Path(args.tasks)
    tasks = read_tasks(tasks_path)
    k2_tok = load_tokenizer(hf)
    hf_tok = AutoTokenizer.from_pretrained(str(hf))
    rows = []
    for it in range(args.warmup + args.iterations):
        for task in draw_prompts(tasks, args.prompts, args.seed, it):
            ids = render_ids(k2_tok, task["messages"], add_generation_prompt=True)
            text = hf_tok.decode(ids, skip_special_tokens=False)
            back = hf_tok(text=text)["input_ids"]
            if back != ids:
                raise SystemExit(f"the HF tokenizer does not reproduce k2's prompt ids: {ids} vs {back}")
            rows.append({"prompt": text, "answer": str(task["answer"]), "task": json.dumps(task)})
    path = out / "trl-prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tasks_path, path


# ----------------------------------------------------------------------------- TRL (own process)


def run_trl_side(spec: dict) -> None:
    """Runs in a fresh process: GRPOTrainer on the spec, one JSON row per iteration to spec['result']."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from k2_rl.rewards import get_reward
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    P, K, U = spec["prompts"], spec["samples"], spec["updates"]
    n_iter = spec["warmup"] + spec["iterations"]
    rows = [json.loads(line) for line in Path(spec["prompts_file"]).read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "answer": r["answer"], "task": r["task"]} for r in rows]
    )
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    # stop where k2's engine stops: EOS and <|im_end|>
    model.generation_config.eos_token_id = sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})
    reward = get_reward(spec["reward"])
    scores: list[float] = []

    def k2_reward(prompts, completions, answer, task, **_kw) -> list[float]:
        out = []
        for completion, task_json in zip(completions, task):
            t = json.loads(task_json)
            out.append(float(reward(t["messages"][-1]["content"], completion, t)))
        scores.extend(out)
        return out

    k2_reward.__name__ = f"k2_rl_{spec['reward']}"
    config = GRPOConfig(
        output_dir=spec["trl_out"],
        per_device_train_batch_size=P * K,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=K,
        num_iterations=U,
        max_completion_length=spec["max_response_tokens"],
        max_steps=n_iter * U,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        use_vllm=False,
        shuffle_dataset=False,
        dataloader_num_workers=0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=spec["seed"],
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[k2_reward], args=config, train_dataset=dataset, processing_class=tok
    )
    acc = {"generation_s": 0.0, "reward_s": 0.0, "tokens": []}

    def timed(name, fn, on_result=None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            res = fn(*a, **kw)
            acc[name] += time.perf_counter() - t0
            if on_result is not None:
                on_result(res)
            return res

        return wrapper

    generate = timed(
        "generation_s", trainer._generate, lambda res: acc["tokens"].extend(len(c) for c in res[1])
    )
    calls = [0]

    def checked_generate(prompts, *a, **kw):
        # the prompts k2 rl draws at this iteration, each K times
        i = calls[0]
        calls[0] += 1
        want = sorted(r["prompt"] for r in rows[i * P : (i + 1) * P] for _ in range(K))
        if sorted(prompts) != want:
            raise RuntimeError(f"TRL iteration {i + 1} did not get the prompts k2 rl draws")
        return generate(prompts, *a, **kw)

    trainer._generate = checked_generate
    trainer._calculate_rewards = timed("reward_s", trainer._calculate_rewards)
    results: list[dict] = []

    class IterationTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step % U:
                return
            now = time.perf_counter()
            total = now - self.t
            self.t = now
            row = {
                "iteration": state.global_step // U,
                "generation_s": acc["generation_s"],
                "reward_s": acc["reward_s"],
                "training_s": total - acc["generation_s"] - acc["reward_s"],
                "sync_s": None,
                "total_s": total,
                "response_tokens_mean": statistics.mean(acc["tokens"]) if acc["tokens"] else 0.0,
                "reward_mean": statistics.mean(scores) if scores else 0.0,
            }
            results.append(row)
            print(f"[trl] iteration {row['iteration']}: {json.dumps(row)}", flush=True)
            acc.update(generation_s=0.0, reward_s=0.0, tokens=[])
            scores.clear()

    trainer.add_callback(IterationTimer())
    trainer.train()
    assert len(results) == n_iter, f"TRL ran {len(results)} iterations, expected {n_iter}"
    Path(spec["result"]).write_text(json.dumps(results))


# ----------------------------------------------------------------------------- k2 (its CLI)


def run_k2_side(args: argparse.Namespace, hf: Path, tasks: Path, optimizer: str, out: Path) -> list[dict]:
    run_dir = out / f"k2-{optimizer}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [
        sys.executable, "-m", "k2_stack", "rl",
        "--init", str(hf), "--tasks", str(tasks), "--reward", args.reward,
        "--iterations", str(args.warmup + args.iterations),
        "--prompts-per-iteration", str(args.prompts), "--samples-per-prompt", str(args.samples),
        "--max-response-tokens", str(args.max_response_tokens), "--truncation-penalty", "0",
        "--updates-per-iteration", str(args.updates), "--optimizer", optimizer,
        "--eval-every", "0", "--save-every", "0", "--seed", str(args.seed),
        "--threads", str(args.threads), "--rollout-threads", str(args.threads),
        "--reward-workers", str(args.reward_workers), "--device", "cpu", "--out", str(run_dir),
        "--kl-every", str(args.k2_kl_every),
    ]  # fmt: skip
    if optimizer == "adamw":
        cmd += ["--lr", str(args.lr)]
    print("$ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "reward_mean" in r:
            rows.append(
                {
                    "iteration": r["iteration"],
                    "generation_s": r["rollout_s"],
                    "reward_s": r["reward_s"],
                    "training_s": r["train_s"],
                    "sync_s": r["sync_s"],
                    "total_s": r["iteration_s"],
                    "response_tokens_mean": r["response_tokens_mean"],
                    "reward_mean": r["reward_mean"],
                }
            )
    return rows


# ----------------------------------------------------------------------------- report


def summarize(rows: list[dict], warmup: int) -> dict:
    timed = rows[warmup:]
    out = {}
    for key in (*PHASES, "total_s", "response_tokens_mean", "reward_mean"):
        vals = [r[key] for r in timed if r[key] is not None]
        out[key] = statistics.mean(vals) if vals else None
    out["total_min_s"] = min(r["total_s"] for r in timed)
    out["iterations"] = len(timed)
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--init", default=None, help="k2 run dir (exported with k2 export) or HF dir; none: random tiny"
    )
    ap.add_argument("--tasks", default=None, help="task JSONL (none: the generated addition task)")
    ap.add_argument("--reward", default="math", help="k2_rl reward registry name")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per iteration (P)")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (K)")
    ap.add_argument("--max-response-tokens", type=int, default=48, help="response budget (M)")
    ap.add_argument("--updates", type=int, default=1, help="optimizer steps per iteration (U)")
    ap.add_argument("--warmup", type=int, default=1, help="iterations run first and not counted")
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per side")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per process, both sides")
    ap.add_argument("--reward-workers", type=int, default=2, help="k2's reward processes")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW lr, both sides (TRL's default)")
    ap.add_argument("--k2-optimizers", default="adamw,muonclip", help="k2 runs, one per optimizer")
    ap.add_argument("--sides", default="trl,k2", help="which sides to run, in this order")
    ap.add_argument(
        "--k2-kl-every",
        type=int,
        default=0,
        help="k2's --kl-every: its KL estimate is one more forward; TRL at beta=0 computes no KL, so "
        "0 (the default here) times the same work on both sides",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-rl/bench", help="work dir (model, runs, results.json)")
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # internal: a spec JSON
    args = ap.parse_args()
    if args.trl_worker:
        run_trl_side(json.loads(Path(args.trl_worker).read_text()))
        return

    import torch
    import transformers

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - {"trl", "k2"}:
        raise SystemExit(f"--sides {args.sides!r}: expected trl and/or k2, comma-separated")
    hf = prepare_model(args.init, out, args.seed)
    tasks, prompts_file = prepare_prompts(args, hf, out)
    results: dict[str, list[dict]] = {}
    load: dict[str, tuple[float, float]] = {}  # the 1-minute load average before and after each side

    def trl_side() -> None:
        import trl

        spec = {
            "model": str(hf), "prompts_file": str(prompts_file), "reward": args.reward,
            "prompts": args.prompts, "samples": args.samples, "updates": args.updates,
            "max_response_tokens": args.max_response_tokens, "warmup": args.warmup,
            "iterations": args.iterations, "threads": args.threads, "lr": args.lr, "seed": args.seed,
            "trl_out": str(out / "trl"), "result": str(out / "trl-iterations.json"),
        }  # fmt: skip
        spec_path = out / "trl-spec.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        before = os.getloadavg()[0]
        print(
            f"$ python benchmarks/rl_iteration.py  # TRL {trl.__version__} GRPOTrainer, own process",
            flush=True,
        )
        subprocess.run([sys.executable, __file__, "--trl-worker", str(spec_path)], check=True, cwd=ROOT)
        results[TRL_NAME] = json.loads(Path(spec["result"]).read_text())
        load[TRL_NAME] = (before, os.getloadavg()[0])

    def k2_side() -> None:
        for opt in [o.strip() for o in args.k2_optimizers.split(",") if o.strip()]:
            name = {"adamw": "k2 rl (AdamW)", "muonclip": "k2 rl (MuonClip)"}.get(opt, f"k2 rl ({opt})")
            before = os.getloadavg()[0]
            results[name] = run_k2_side(args, hf, tasks, opt, out)
            load[name] = (before, os.getloadavg()[0])

    for side in sides:  # in the order given
        {"trl": trl_side, "k2": k2_side}[side]()
    if TRL_NAME in results:  # TRL first in the table
        results = {TRL_NAME: results.pop(TRL_NAME), **results}

    summary = {name: summarize(rows, args.warmup) for name, rows in results.items()}
    machine = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import trl

        machine["trl"] = trl.__version__
    except ImportError:
        pass
    setup = (
        f"P={args.prompts} prompts x K={args.samples} samples, at most M={args.max_response_tokens} new tokens, "
        f"U={args.updates} optimizer step(s) per iteration, fp32, {args.threads} torch thread(s) per process; "
        f"mean of {args.iterations} iteration(s) after {args.warmup} warm-up"
    )
    print()
    print(f"machine: {machine['cpu']}, {machine['cores_usable']} usable cores of {machine['cores']}; "
          f"torch {machine['torch']}, transformers {machine['transformers']}, trl {machine.get('trl', '-')}")  # fmt: skip
    print(setup)
    print("1-minute load average before/after each side (other work on the machine shows here): "
          + ", ".join(f"{name} {a:.1f}/{b:.1f}" for name, (a, b) in load.items()))  # fmt: skip
    print()
    print("| run | generation s | reward s | training s | sync s | s / iteration | min s / iteration "
          "| response tokens | reward | TRL / this |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = summary.get(TRL_NAME)
    for name, s in summary.items():
        ratio = f"{base['total_s'] / s['total_s']:.2f}x" if base else "-"
        sync = "none (one process)" if name.startswith("TRL") else fmt(s["sync_s"])
        print(
            f"| {name} | {fmt(s['generation_s'])} | {fmt(s['reward_s'])} | {fmt(s['training_s'])} | {sync} "
            f"| {fmt(s['total_s'])} | {fmt(s['total_min_s'])} | {fmt(s['response_tokens_mean'], 1)} "
            f"| {fmt(s['reward_mean'])} | {ratio} |"
        )
    if base:
        print()
        for name, s in summary.items():
            if name.startswith("TRL"):
                continue
            parts = [f"per iteration {base['total_s'] / s['total_s']:.2f}x"]
            for key, label in (
                ("generation_s", "generation"),
                ("reward_s", "reward"),
                ("training_s", "training"),
            ):
                if s[key]:
                    parts.append(f"{label} {base[key] / s[key]:.2f}x")
            print(
                f"{name} vs TRL: "
                + ", ".join(parts)
                + " (TRL seconds / k2 seconds; target per iteration >= 3x)"
            )
    (out / "results.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "setup": setup,
                "args": vars(args),
                "load": load,
                "summary": summary,
                "iterations": results,
            },
            indent=2,
        )
    )
    print(f"\nwrote {out / 'results.json'}")


if __name__ == "__main__":
    main()
