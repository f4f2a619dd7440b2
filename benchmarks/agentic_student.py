"""Agentic synthesis measured by its student: held-out BFCL/tau scores before and after `k2 sft`.

1. Synthesize: `k2 data agentic` (in process) against the competent scripted teacher
   (`ScriptedTeacher(follow_requests=True)` on a loopback endpoint) over the shipped MCP servers' tools,
   simulated (`--simulate-mcp`: the held-out scoring simulates tools too), with `--heldout N`, which
   builds OUT/data/heldout_tasks.jsonl and scores the teacher itself on them (the ceiling).
   No training task may equal a held-out one (asserted).
2. Tokenize OUT/data/sft.jsonl with `k2 data sft`; the token lengths pick `--seq-len` (the smallest
   multiple of 64 holding every training conversation, unless given).
3. `k2 sft` a small K2 (benchmarks/configs/sft_tooluse_small.json) on it; `k2 export` the result and
   the run's random init (the seeded model `k2 sft` started from).
4. Serve each with `k2 serve --model DIR` on loopback and score it with
   `k2 data agentic --eval-only --heldout N` on the same held-out tasks file.

Every stage is skipped when its output exists, so a rerun after a kill continues.

    python benchmarks/agentic_student.py [--agents 300] [--tasks-per-agent 4] [--tools-per-agent 6] \
        [--heldout 100] [--steps 2000] [--out runs/agentic-student]

Writes OUT/results.json and prints the markdown table that goes into packages/k2-data/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench_common import machine, run_k2
from sft_tooluse import ROOT, Server, _steps_done, export_random_init

CONFIG = ROOT / "benchmarks" / "configs" / "sft_tooluse_small.json"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def synthesize(args: argparse.Namespace, data: Path) -> dict:
    """The pipeline against the competent scripted teacher; its summary.json (read back when done)."""
    if not (data / "summary.json").is_file():
        from k2_data.agentic.cli import main as agentic
        from k2_data.agentic.scripted import ScriptedTeacher
        from k2_data.loopback import LoopbackServer

        with LoopbackServer(ScriptedTeacher(follow_requests=True)) as teacher:
            argv = ["--out", str(data), "--base-url", teacher.base_url, "--model", "teacher"]
            argv += ["--simulate-mcp", "--no-coverage", "--heldout", str(args.heldout)]
            argv += ["--agents", str(args.agents), "--tasks-per-agent", str(args.tasks_per_agent)]
            argv += ["--tools-per-agent", str(args.tools_per_agent), "--seed", str(args.seed)]
            if agentic(argv) != 0:
                raise RuntimeError("k2 data agentic failed")
    train = {t["user_request"] for t in read_jsonl(data / "tasks.jsonl")}
    heldout = {t["user_request"] for t in read_jsonl(data / "heldout_tasks.jsonl")}
    overlap = train & heldout
    assert not overlap, f"{len(overlap)} training tasks equal held-out ones, e.g. {sorted(overlap)[0]}"
    return json.loads((data / "summary.json").read_text())


def token_lengths(shards: Path) -> list[int]:
    import pyarrow.ipc as ipc

    out: list[int] = []
    for f in sorted(shards.glob("*.arrow")):
        with ipc.open_file(f) as reader:
            out += [len(x) for x in reader.read_all().column("input_ids").to_pylist()]
    return out


def heldout_lengths(data: Path) -> list[int]:
    """Tokens of each held-out task solved (its system prompt, tools, request, the expected calls and a
    short answer): the context the student needs at evaluation."""
    from k2_data.agentic.pipeline import HELDOUT_SYSTEM_PROMPT
    from k2_data.agentic.repository import ToolRepository
    from k2_data.agentic.state import classify
    from k2_data.chat import render_ids_with_mask
    from k2_data.ingest import load_tokenizer

    tok = load_tokenizer(None)
    tasks = read_jsonl(data / "heldout_tasks.jsonl")
    colls = {classify(c["name"])[1] for t in tasks for c in t["rubric"]["expected_calls"]}
    repo = ToolRepository.load(data / "tools.jsonl")
    tools = [e.spec for e in repo.entries if (k := classify(e.spec["function"]["name"])) and k[1] in colls]
    out = []
    for t in tasks:
        msgs = [
            {"role": "system", "content": HELDOUT_SYSTEM_PROMPT},
            {"role": "user", "content": t["user_request"]},
        ]
        for i, c in enumerate(t["rubric"]["expected_calls"]):
            call = {
                "id": f"c{i}",
                "type": "function",
                "function": {**c, "arguments": json.dumps(c["arguments"])},
            }
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": '{"status": "created", "id": "x"}'},
            ]
        msgs.append({"role": "assistant", "content": "Done."})
        out.append(len(render_ids_with_mask(tok, msgs, tools)[0]))
    return out


def tokenize(data: Path, shards: Path) -> dict:
    if not (shards / "manifest.json").is_file():
        t0 = time.perf_counter()
        run_k2("data", "sft", str(data / "sft.jsonl"), "--out", str(shards))
        (shards / "seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    lengths = sorted(token_lengths(shards))
    held = sorted(heldout_lengths(data))
    manifest = json.loads((shards / "manifest.json").read_text())

    def pct(xs: list[int], q: float) -> int:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "conversations": len(lengths),
        "tokens": sum(lengths),
        "trained_tokens": manifest.get("num_trained_tokens"),
        "train_len": {"median": pct(lengths, 0.5), "p99": pct(lengths, 0.99), "max": lengths[-1]},
        "heldout_len": {"median": pct(held, 0.5), "max": held[-1]},
        "seconds": float((shards / "seconds.txt").read_text())
        if (shards / "seconds.txt").is_file()
        else None,
    }


def train(args: argparse.Namespace, shards: Path, run: Path, seq_len: int) -> dict:
    if not (run / "state" / "latest").is_file():
        run_k2(
            "sft", "--config", str(args.config), "--data", str(shards), "--seq-len", str(seq_len),
            "--steps", str(args.steps), "--seed", str(args.seed), "--threads", str(args.threads),
            "--out", str(run), "--json", *args.sft_args.split(),
        )  # fmt: skip
    elif _steps_done(run) < args.steps:  # stopped part-way: continue exactly
        run_k2("sft", "--resume", str(run), "--json")
    metrics = read_jsonl(run / "metrics.jsonl")
    return {
        "steps": metrics[-1]["step"],
        "seq_len": seq_len,
        "train_s": sum(m.get("step_s") or 0.0 for m in metrics),
        "first_loss": metrics[0]["loss"],
        "final_loss": metrics[-1]["loss"],
        "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),
    }


def score(args: argparse.Namespace, data: Path, model: Path, scores: Path) -> dict:
    """`k2 serve --model` on loopback scored by `k2 data agentic --eval-only` on the held-out tasks."""
    if not scores.is_file():
        with Server("--model", str(model), "--device", "cpu") as srv:
            run_k2(
                "data", "agentic", "--out", str(data), "--eval-only", "--heldout", str(args.heldout),
                "--base-url", srv.url + "/v1", "--model", "m", "--simulate-mcp", "--no-coverage",
                "--max-tokens", str(args.eval_max_tokens), "--scores-file", str(scores),
            )  # fmt: skip
    return summarize(json.loads(scores.read_text()))


def summarize(scored: dict) -> dict:
    """The CLI's summary: BFCL accuracy, call recall, tool-name recall (right tool, arguments aside)
    and final-state accuracy."""
    keys = ("tasks", "bfcl_accuracy", "call_recall", "tool_name_recall", "state_accuracy")
    return {**{k: scored["summary"][k] for k in keys}, "seconds": scored["summary"].get("seconds")}


def noop_state_accuracy(data: Path) -> float:
    """The final-state accuracy of an agent that calls nothing: the share of held-out tasks whose
    expected state is empty (a record created, then deleted)."""
    tasks = read_jsonl(data / "heldout_tasks.jsonl")
    return sum(not t["rubric"]["expected_state"] for t in tasks) / len(tasks)


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| model | BFCL accuracy | call recall | tool-name recall | final-state accuracy |",
        "|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['bfcl_accuracy']:.1%} | {r['call_recall']:.1%} | {r['tool_name_recall']:.1%} | "
            f"{r['state_accuracy']:.1%} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "agentic-student")
    ap.add_argument("--agents", type=int, default=300)
    ap.add_argument("--tasks-per-agent", type=int, default=4)
    ap.add_argument("--tools-per-agent", type=int, default=6)
    ap.add_argument("--heldout", type=int, default=100)
    ap.add_argument("--config", type=Path, default=CONFIG, help="k2 sft config of the student")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument(
        "--seq-len", type=int, default=0, help="0: smallest multiple of 64 holding every conversation"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads of k2 sft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft-args", default="", help="extra flags for k2 sft, e.g. '--batch 16'")
    ap.add_argument("--eval-max-tokens", type=int, default=128, help="per student reply in the evaluation")
    args = ap.parse_args()
    data, shards, run = args.out / "data", args.out / "shards", args.out / "sft"
    args.out.mkdir(parents=True, exist_ok=True)

    synth = synthesize(args, data)
    print(
        f"synthesized: {synth['accepted']}/{synth['trajectories']} accepted in {synth['seconds']} s",
        flush=True,
    )
    toks = tokenize(data, shards)
    seq_len = args.seq_len or -(-toks["train_len"]["max"] // 64) * 64
    print(
        f"tokenized: {toks['conversations']} conversations, lengths {toks['train_len']}, seq-len {seq_len}",
        flush=True,
    )
    sft = train(args, shards, run, seq_len)
    print(
        f"trained: {sft['steps']} steps in {sft['train_s']:.0f} s, loss {sft['final_loss']:.3f}", flush=True
    )
    if not (args.out / "student-hf" / "config.json").is_file():
        run_k2("export", str(run), "--out", str(args.out / "student-hf"))
    if not (args.out / "init-hf" / "config.json").is_file():
        export_random_init(run, args.out / "init-hf")
    rows = {
        "random init (step 0)": score(args, data, args.out / "init-hf", args.out / "scores_init.json"),
        f"after `k2 sft` ({sft['steps']} steps)": score(
            args, data, args.out / "student-hf", args.out / "scores_sft.json"
        ),
        "teacher (scripted, ceiling)": summarize(json.loads((data / "heldout_scores.json").read_text())),
    }
    results = {
        "machine": machine(),
        "synthesis": {
            k: synth[k]
            for k in ("tools", "agents", "tasks", "trajectories", "accepted", "acceptance_rate", "seconds")
        }
        | {"trajectories_per_second": synth["trajectories_per_second"], "requests": synth["client"]},
        "tokens": toks,
        "sft": sft,
        "heldout_tasks": args.heldout,
        # created then deleted: the final state is empty, so an agent that does nothing matches it
        "noop_state_accuracy": noop_state_accuracy(data),
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    s = results["synthesis"]
    print(f"\nmachine: {results['machine']}")
    print(
        f"synthesis: {s['agents']} agents x {args.tasks_per_agent} tasks -> {s['trajectories']} trajectories, "
        f"{s['accepted']} accepted, {s['seconds']} s ({s['trajectories_per_second']} trajectories/s)"
    )
    print(
        f"student: {args.config.name}, seq-len {seq_len}, {sft['steps']} steps in {sft['train_s'] / 60:.1f} min, "
        f"loss {sft['first_loss']:.2f} -> {sft['final_loss']:.3f}; {args.heldout} held-out tasks\n"
    )
    print(table(rows))
    print(
        f"\n(an agent that calls nothing reaches {results['noop_state_accuracy']:.1%} final-state accuracy)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
