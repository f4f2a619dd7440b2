"""The k2-train SFT proof: tool calling learned by the tiny K2 from the shipped tool-use set.

For each seed: `k2 sft` on the generated tool-use set (k2_data.examples.tooluse, train split),
`k2 export`, then `k2 serve --model` answers every held-out prompt with `tool_choice="auto"` (no
guided decoding forcing a call) at temperature 0. A case counts only when the tool name AND the
parsed arguments equal the reference, and a no-tool prompt gets no call. The baseline is the same
server on the run's own random init: the architecture and seeded init `k2 sft` starts from, exported
before any step (so a `--config` with `model_overrides` gets its own baseline).

    python benchmarks/sft_tooluse.py [--seeds 0 1 2] [--steps 300] [--out runs/sft-tooluse] [--device cuda]

Writes OUT/results.json and prints the markdown table that goes into packages/k2-train/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_common import run_k2

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`k2 serve` in a subprocess on a free loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "k2_stack",
            "serve",
            *args,
            "--port",
            str(self.port),
            "--served-model-name",
            "m",
            "--no-ckpt-receiver",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Server:
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"k2 serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("k2 serve did not come up in 300 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def evaluate(url: str, heldout: list[dict], max_tokens: int, workers: int = 8) -> dict:
    """Accuracy over `heldout` (each: messages, tools, reference) through the chat endpoint."""
    from k2_data.examples.tooluse import score_tool_call

    def one(rec: dict) -> tuple[bool, dict]:
        body = {
            "model": "m",
            "messages": rec["messages"],
            "tools": rec["tools"],
            "tool_choice": "auto",
            "temperature": 0.0,
            "max_tokens": max_tokens,
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        msg = r.json()["choices"][0]["message"]
        return score_tool_call(rec["reference"], msg), msg

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, heldout))

    def right_tool(rec: dict, msg: dict) -> bool:  # the call's name alone (or no call), arguments aside
        calls = msg.get("tool_calls") or []
        if rec["reference"] is None:
            return not calls
        return len(calls) == 1 and calls[0]["function"]["name"] == rec["reference"]["name"]

    by_kind: dict[str, list[bool]] = {}
    for rec, (ok, _) in zip(heldout, results):
        kind = rec["reference"]["name"] if rec["reference"] else "no tool"
        by_kind.setdefault(kind, []).append(ok)
    return {
        "accuracy": sum(ok for ok, _ in results) / len(results),
        "tool_name_accuracy": sum(right_tool(rec, msg) for rec, (_, msg) in zip(heldout, results))
        / len(results),
        "by_kind": {k: sum(v) / len(v) for k, v in sorted(by_kind.items())},
        "n": len(results),
        "seconds": time.perf_counter() - t0,
        "examples": [
            {"prompt": rec["messages"][-1]["content"], "reference": rec["reference"], "message": msg}
            for rec, (_, msg) in list(zip(heldout, results))[:8]
        ],
    }


def export_random_init(run: Path, out: Path) -> Path:
    """The model `k2 sft` started `run` from (its config's architecture, seeded init), exported."""
    import torch
    from k2_train.builders import build_model
    from k2_train.config import SFTConfig
    from k2_train.export import export_model

    saved = json.loads((run / "config.json").read_text())
    saved.pop("task", None)
    cfg = SFTConfig.from_dict(saved, source=str(run / "config.json"))
    model = build_model(cfg.model, 0, torch.device("cpu"), cfg.seed)
    return export_model(model, run / "tokenizer", out, force=True)


def _steps_done(run: Path) -> int:
    lines = (run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").is_file() else []
    return json.loads(lines[-1])["step"] if lines else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "sft-tooluse")
    ap.add_argument(
        "--heldout", type=int, default=0, help="evaluate only the first N held-out prompts (0 = all)"
    )
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--sft-args", default="", help="extra flags for k2 sft, e.g. '--lr 0.02 --batch 16'")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where k2 sft trains and k2 serve serves")
    args = ap.parse_args()

    from k2_train.data import tooluse_example_dir

    heldout = [
        json.loads(line) for line in (tooluse_example_dir() / "heldout.jsonl").read_text().splitlines()
    ]
    if args.heldout:
        heldout = heldout[: args.heldout]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        run = args.out / f"seed{seed}"
        hf = args.out / f"seed{seed}-hf"
        if not (run / "state" / "latest").is_file():
            run_k2(
                "sft",
                "--seed",
                str(seed),
                "--steps",
                str(args.steps),
                "--out",
                str(run),
                "--json",
                "--device",
                args.device,
                *args.sft_args.split(),
            )
        elif _steps_done(run) < args.steps:  # a run stopped part-way: continue it exactly
            run_k2("sft", "--resume", str(run), "--json")
        # the run may have been trained earlier (or beside other runs): its own step times count
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train_s = sum(m.get("step_s") or 0.0 for m in metrics)
        run_k2("export", str(run), "--out", str(hf), "--force")
        with Server("--model", str(hf), "--device", args.device) as srv:
            sft = evaluate(srv.url, heldout, args.max_tokens)
        init = export_random_init(run, args.out / f"seed{seed}-init-hf")
        with Server("--model", str(init), "--device", args.device) as srv:
            base = evaluate(srv.url, heldout, args.max_tokens)
        rows.append(
            {
                "seed": seed,
                "random_init": base,
                "sft": sft,
                "train_s": train_s,
                "final_loss": metrics[-1]["loss"],
                "val_loss": next((m["val_loss"] for m in reversed(metrics) if "val_loss" in m), None),
            }
        )
        print(
            f"seed {seed}: random init {base['accuracy']:.1%}, SFT {sft['accuracy']:.1%} "
            f"({sft['by_kind']}), train {train_s:.0f} s",
            flush=True,
        )

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    try:
        machine = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
        machine += f", {os.cpu_count()} cores"
    except (OSError, StopIteration):
        pass
    if args.device.startswith("cuda"):
        import torch

        machine += f"; trained and served on {torch.cuda.get_device_name(0)}"
    summary = {
        "machine": machine,
        "steps": args.steps,
        "heldout": len(heldout),
        "rows": rows,
        "sft_mean": statistics.mean(r["sft"]["accuracy"] for r in rows),
        "random_mean": statistics.mean(r["random_init"]["accuracy"] for r in rows),
    }
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    kinds = sorted(rows[0]["sft"]["by_kind"])
    print(
        f"\nmachine: {machine}; {args.steps} SFT steps; {len(heldout)} held-out prompts; tool_choice=auto, greedy\n"
    )
    print("| seed | random init | SFT | " + " | ".join(f"SFT: {k}" for k in kinds) + " | SFT train time |")
    print("|---|---|---|" + "---|" * len(kinds) + "---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['random_init']['accuracy']:.1%} | {r['sft']['accuracy']:.1%} | "
            + " | ".join(f"{r['sft']['by_kind'].get(k, 0):.0%}" for k in kinds)
            + f" | {r['train_s'] / 60:.1f} min |"
        )
    print(f"| mean | {summary['random_mean']:.1%} | {summary['sft_mean']:.1%} |" + " |" * len(kinds) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
