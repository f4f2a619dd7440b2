"""Run directories written by earlier code still resume: one committed run of each kind
(tests/fixtures/run_dirs/{pretrain,sft,rl}, made by tests/fixtures/make_runs.py and stopped half-way)
is copied and continued with `k2 ... --resume` to its planned end. A change to the configs, the
train state or the loop that old runs cannot survive fails here; regenerate the fixtures only
when the format change is deliberate (and say so in the commit)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from k2_stack.cli import main

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "run_dirs"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def copy_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the stored configs name their data and tokenizer relative to the root
    monkeypatch.setenv("K2_CACHE", str(tmp_path / "cache"))

    def copy(kind: str) -> Path:
        dst = tmp_path / kind
        shutil.copytree(FIXTURES / kind, dst)
        return dst

    return copy


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_a_stored_training_run_resumes_to_its_end(copy_run, kind):
    run = copy_run(kind)
    stored = json.loads((run / "config.json").read_text())
    before = _rows(run)
    assert [r["step"] for r in before] == list(range(1, stored["stop_at"] + 1))
    assert main([kind, "--resume", str(run), "--json"]) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, stored["steps"] + 1))
    assert rows[: len(before)] == before  # what was logged before the stop is kept as it was
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert (run / "state" / f"step_{stored['steps']:06d}" / "state.pt").is_file()


@pytest.mark.slow  # spawns the rollout worker and a reward worker
def test_a_stored_rl_run_resumes_to_its_end(copy_run):
    run = copy_run("rl")
    stored = json.loads((run / "config.json").read_text())
    its = lambda rows: [r["iteration"] for r in rows if "reward_mean" in r]  # noqa: E731
    assert its(_rows(run)) == list(range(1, stored["stop_at"] + 1))
    assert main(["rl", "--resume", str(run), "--json"]) == 0
    rows = _rows(run)
    assert its(rows) == list(range(1, stored["iterations"] + 1))
    assert all(math.isfinite(r["reward_mean"]) for r in rows if "reward_mean" in r)
