"""Smoke runs of benchmark scripts on tiny sizes: they must run and print their tables (no timing
is asserted; the numbers are measured by hand on a quiet machine and go into the READMEs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str) -> str:
    # no -P: run the way the docstrings say, with benchmarks/ first on sys.path
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_no_benchmark_script_shadows_a_stdlib_module():
    # `python benchmarks/x.py` puts benchmarks/ first on sys.path, so a script named like a standard
    # library module (say `tokenize`) would be imported in its place by torch, datasets and the like.
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts and not scripts & sys.stdlib_module_names, sorted(scripts & sys.stdlib_module_names)


@pytest.mark.slow
def test_attention_benchmark_prints_its_table():
    out = run_bench("attention.py", "--seqs", "64,160", "--heads", "2", "--repeats", "1")
    rows = [line for line in out.splitlines() if line.startswith(("| 64 |", "| 160 |"))]
    assert len(rows) == 2
    cells = rows[1].strip("|").split("|")
    assert len(cells) == 11 and all(c.strip() not in ("", "-") for c in cells)  # memory measured too


def test_k2vv_conformance_benchmark_prints_its_table():
    out = run_bench("k2vv.py", "--synthetic", "10", "--max-tokens", "16")
    (row,) = [line for line in out.splitlines() if line.startswith("| 10 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # every request answered (200 or a named 400; 2 of 10 are malformed on purpose), no markup, streams agree
    assert cells[2] == "2" and cells[3] == "0" and cells[7:9] == ["0", "0"], row


def test_rephrase_client_benchmark_prints_its_table():
    out = run_bench(
        "rephrase.py", "--concurrency", "4", "--requests", "20", "--sequential", "3", "--latency-ms", "50"
    )
    assert "machine: " in out
    rows = [
        line for line in out.splitlines() if line.startswith(("| sequential loop", "| AsyncHTTPChatClient"))
    ]
    assert len(rows) == 2, out


@pytest.mark.slow
def test_rl_iteration_benchmark_prints_its_table(tmp_path):
    pytest.importorskip("trl", reason="TRL is a benchmark-only dependency: pip install 'k2-rl[bench]'")
    # random tiny weights, 2 prompts x 2 samples of 4 tokens, one iteration per side
    out = run_bench(
        "rl_iteration.py", "--prompts", "2", "--samples", "2", "--max-response-tokens", "4",
        "--warmup", "0", "--iterations", "1", "--threads", "1", "--reward-workers", "1",
        "--k2-optimizers", "adamw", "--out", str(tmp_path),
    )  # fmt: skip
    assert "machine: " in out
    rows = [line for line in out.splitlines() if line.startswith(("| TRL GRPOTrainer", "| k2 rl (AdamW)"))]
    assert len(rows) == 2, out
    assert all(c.strip() not in ("", "-") for c in rows[1].strip("|").split("|"))  # k2: every phase measured
    assert "k2 rl (AdamW) vs TRL: per iteration" in out


@pytest.mark.slow
def test_serve_load_benchmark_measures_k2_and_transformers_serve():
    # the tiny preset's random weights with the Kimi chat template; transformers serve must answer every
    # request with a non-empty output (the script asserts it and exits non-zero otherwise)
    out = run_bench(
        "serve_load.py", "--requests", "2", "--clients", "2", "--max-tokens", "2", "--threads", "1",
        "--followups", "1", "--anchor", "transformers",
    )  # fmt: skip
    assert "machine: " in out
    rows = [line for line in out.splitlines() if line.startswith(("| k2 serve |", "| transformers serve"))]
    assert len(rows) == 2, out
    assert all(row.rstrip().endswith("| 2/2 |") for row in rows), out
    assert "k2 serve / transformers serve output tokens/s" in out


def test_serve_vs_vllm_benchmark_runs_k2_alone():
    # no vLLM: k2 serve alone on the tiny preset, two rounds (the order alternates), two loads
    out = run_bench(
        "serve_vs_vllm.py", "--servers", "k2", "--preset", "tiny", "--rounds", "2", "--loads", "1x2,3x1",
        "--max-tokens", "4", "--prompt-len", "5", "--k2-threads", "1",
    )  # fmt: skip
    assert "machine: " in out and "CPU flags: " in out and "k2 serve --threads 1" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"load", "1 client x 2", "3 clients x 1"}, out
    for load in ("1 client x 2", "3 clients x 1"):
        tok_s, ttft, itl = (float(c) for c in rows[load].strip("|").split("|")[1:])
        assert tok_s > 0 and ttft > 0 and itl > 0, rows[load]


@pytest.mark.slow
def test_rl_proof_driver_runs_every_stage(tmp_path):
    # one seed, one objective, one iteration: SFT, k2 rl, the continued-SFT baseline, the ruler, the table
    out = run_bench(
        "rl_proof.py", "--seeds", "0", "--objectives", "k15", "--iterations", "1", "--sft-steps", "2",
        "--out", str(tmp_path), "--task-args", "--n-sft 64 --n-rl 32 --n-heldout 8",
        "--sft-args", "--seq-len 128 --batch 4 --eval-every 0 --save-every 0 --threads 1",
        "--rl-args", "--prompts-per-iteration 2 --samples-per-prompt 2 --max-response-tokens 8 --eval-every 1 "
        "--eval-prompts 4 --reward-workers 1 --threads 1 --rollout-threads 1",
    )  # fmt: skip
    assert "| seed | SFT | SFT continued (same steps) | RL, K1.5 objective |" in out
    assert (tmp_path / "rl_proof.png").stat().st_size > 1000
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["seeds"]["0"]["rl_steps"] == 1 and "baseline_accuracy" in results["seeds"]["0"]


@pytest.mark.slow
def test_agentic_student_benchmark_scores_before_and_after(tmp_path):
    # a handful of teacher trajectories, 2 SFT steps, 4 held-out tasks scored on both exported students
    out = run_bench(
        "agentic_student.py", "--out", str(tmp_path), "--agents", "4", "--tasks-per-agent", "2",
        "--heldout", "4", "--steps", "2", "--eval-max-tokens", "16",
        "--sft-args", "--batch 2 --eval-every 0 --save-every 0",
    )  # fmt: skip
    assert "machine: " in out and "| model | BFCL accuracy |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| random init", "| after `k2 sft`"))]
    assert len(rows) == 2, out
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        len(results["rows"]) == 3 and results["rows"]["teacher (scripted, ceiling)"]["bfcl_accuracy"] == 1.0
    )
    assert all(r["tasks"] == 4 for r in results["rows"].values()) and results["sft"]["steps"] == 2


@pytest.mark.slow
def test_qat_proof_driver_runs_every_stage(tmp_path):
    # one seed, two SFT steps each: FP and QAT runs, both exports, the three scores, the table
    out = run_bench(
        "qat_proof.py", "--seeds", "0", "--steps", "2", "--out", str(tmp_path), "--heldout", "8",
        "--loss-conversations", "4", "--gen-prompts", "2", "--gen-tokens", "4",
    )  # fmt: skip
    assert "| model | eval loss | greedy agreement with FP | held-out accuracy |" in out
    results = json.loads((tmp_path / "qat_proof.json").read_text())["results"]
    assert results["FP"]["agreement"] == [1.0] and set(results) == {"FP", "PTQ", "QAT"}
    assert (tmp_path / "seed0" / "qat-int4" / "config.json").is_file()
    assert (tmp_path / "qat_proof.png").stat().st_size > 0  # the per-seed bar chart
    # a coarser width: the FP run is reused, QAT trains at 2 bits, the deployed experts are rounded
    out = run_bench(
        "qat_proof.py", "--seeds", "0", "--steps", "2", "--out", str(tmp_path), "--heldout", "8",
        "--loss-conversations", "4", "--gen-prompts", "2", "--gen-tokens", "4", "--bits", "2",
    )  # fmt: skip
    assert "2-bit routed experts" in out
    two = json.loads((tmp_path / "qat_proof-int2.json").read_text())
    assert two["bits"] == 2 and set(two["results"]) == {"FP", "PTQ", "QAT"}
    assert two["results"]["FP"] == results["FP"]  # the same FP run, scored the same
    assert (tmp_path / "seed0" / "qat-int2-deployed" / "config.json").is_file()
    # the report again from the stored results, with the setup the runs had
    again = run_bench("qat_proof.py", "--out", str(tmp_path), "--bits", "2", "--report-only", "--steps", "7")
    assert "seeds [0], 2 SFT steps on 2400 additions, 2-bit routed experts" in again
    assert json.loads((tmp_path / "qat_proof-int2.json").read_text())["results"] == two["results"]
    # finished runs on other data are never reused as if they were this count's
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "qat_proof.py"), "--seeds", "0", "--steps", "2", "--out",
         str(tmp_path), "--n-sft", "16", "--heldout", "8"], capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode != 0 and "another --n-sft needs another --out" in res.stderr, res.stderr[-2000:]


def test_qat_proof_gap_summary_against_hand_computed_values(monkeypatch):
    # the bar's arithmetic on numbers worked out by hand: paired gaps, the t interval, QAT's share
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from qat_proof import ci95, ptq_gap

    results = {
        "FP": {"accuracy": [0.50, 0.60, 0.40], "eval_loss": [0.20, 0.30, 0.25]},
        "PTQ": {"accuracy": [0.44, 0.52, 0.34], "eval_loss": [0.20, 0.30, 0.25]},
        "QAT": {"accuracy": [0.49, 0.57, 0.39], "eval_loss": [0.21, 0.31, 0.26]},
    }
    acc = ptq_gap(results, "accuracy", -1.0)
    assert acc["gap_per_seed"] == pytest.approx([0.06, 0.08, 0.06])
    assert acc["gap"] == pytest.approx(0.2 / 3)
    # sd of (0.06, 0.08, 0.06) = 0.011547; t(2 df) = 4.303; / sqrt(3)
    assert acc["ci95"] == pytest.approx(4.303 * 0.0115470 / 3**0.5, rel=1e-4)
    assert acc["beyond_noise"] and acc["spread"] == pytest.approx(0.02)
    # QAT's mean 0.4833 against PTQ's 0.4333 and FP's 0.5: it closes 0.05 / 0.0667 = 75%
    assert acc["closed"] == pytest.approx(0.75)
    loss = ptq_gap(results, "eval_loss", 1.0)
    assert loss["gap"] == 0 and loss["closed"] is None and not loss["beyond_noise"]
    assert ci95([1.0]) == float("inf") and ptq_gap({k: {"m": [1.0]} for k in results}, "m", 1)["ci95"] is None


@pytest.mark.slow
def test_agentic_rl_proof_driver_runs_every_stage(tmp_path):
    # one seed, every stage at its smallest: the base, the student, RL, the baseline, the rulers
    out = run_bench(
        "agentic_rl_proof.py", "--seeds", "0", "--out", str(tmp_path), "--base-steps", "2", "--copy-docs", "200",
        "--copy-share", "0.7", "--repeat-convs", "4",
        "--base-args", "--seq-len 64 --batch 2 --max-corpus-mb 0.05 --eval-every 0 --save-every 2 --threads 1",
        "--sft-steps", "2", "--iterations", "1", "--indist", "6",
        "--data-args", "--sft 8 --requests 2 --tasks 8 --heldout 6",
        "--sft-args", "--seq-len 640 --batch 2 --eval-every 0 --save-every 2 --threads 1",
        "--rl-args", "--prompts-per-iteration 2 --samples-per-prompt 2 --max-response-tokens 16 --max-turns 2 "
        "--eval-every 1 --eval-prompts 6 --threads 1 --rollout-threads 1",
    )  # fmt: skip
    assert (
        "| seed | policy | in-distribution | held-out (all) | values | compositions | tools (unseen names) |"
        in out
    )
    assert "scripted: nothing" in out and "RL over SFT continued, held-out" in out
    results = json.loads((tmp_path / "results.json").read_text())
    probe = results["base_copy_probe"]
    assert set(probe) == {"sequence", "pairs"} and all(set(v) == {"train", "heldout"} for v in probe.values())
    seed = results["seeds"]["0"]
    assert seed["rl_steps"] == 1 and seed["baseline"]["heldout_n"] == 6
    assert results["scripted"]["nothing"]["heldout_accuracy"] == 0.0
    assert (tmp_path / "agentic_rl_proof.png").is_file()
    assert len((tmp_path / "data" / "sft-repeat4.jsonl").read_text().splitlines()) == 8 + 4


def test_paged_decode_benchmark_prints_its_tables():
    out = run_bench("paged_decode.py", "--repeats", "2", "--engine-rounds", "1")
    assert "| attention (one layer) |" in out and "| engine, sequences |" in out
    assert out.count(" heads x ") == 4 and out.count("x |") >= 7  # 4 shapes, 3 engine sizes


def test_engine_step_benchmark_prints_its_table():
    out = run_bench(
        "engine_step.py", "--batches", "1", "2", "--repeats", "1", "--new-tokens", "4", "--prompt-tokens", "8"
    )
    rows = [line for line in out.splitlines() if line.startswith(("| float32 |", "| bfloat16 |"))]
    assert len(rows) == 4, out  # 2 dtypes x 2 batch sizes
    assert all(float(r.split("|")[3]) > 0 for r in rows)
