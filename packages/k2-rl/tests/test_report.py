"""k2_rl.report: the change of reward and held-out accuracy over a run, against its standard error."""

from __future__ import annotations

import math

import pytest
from k2_rl.report import heldout_change, reward_change


def test_heldout_change_uses_the_binomial_standard_error():
    rows = [
        {"iteration": 0, "heldout_accuracy": 0.50},
        {"iteration": 5, "reward_mean": 0.4},
        {"iteration": 10, "heldout_accuracy": 0.60},
    ]
    c = heldout_change(rows, 400)
    assert c.start == 0.5 and c.end == 0.6
    assert c.stderr == pytest.approx(math.sqrt(0.25 / 400 + 0.24 / 400))  # 0.0347
    assert c.significant  # +10 points > 2 x 3.5
    assert "50.0% -> 60.0% (+10.0 points; standard error 3.5 points): up by more than" in c.line(pct=True)
    small = heldout_change([{"iteration": 0, "heldout_accuracy": 0.25}, {"heldout_accuracy": 0.29}], 100)
    assert not small.significant and "noise" in small.line(pct=True)  # the old rl-demo's 25% -> 29%
    assert heldout_change([{"heldout_accuracy": 0.5}], 400) is None  # no baseline row


def test_reward_change_compares_windows_of_iterations():
    rows = [{"reward_mean": r} for r in (0.18, 0.20, 0.16, 0.1, 0.1, 0.1, 0.05, 0.04, 0.03)]
    c = reward_change(rows, window=3)
    assert c.start == pytest.approx(0.18) and c.end == pytest.approx(0.04)
    assert c.stderr == pytest.approx(math.sqrt(0.0004 / 3 + 0.0001 / 3))
    assert "DOWN by more than two standard errors" in c.line(pct=False)
    assert reward_change(rows[:5], window=3) is None
