"""RewardPool: correct rewards in input order from worker processes; hangs, errors and crashes score 0.0."""

from __future__ import annotations

import os
import time

import pytest
from k2_rl.rewards.pool import PoolResult, RewardPool

# Helper rewards live in this file; workers load them with a "path.py:attr" spec because the
# test module is not importable by name under pytest's importlib mode.
HERE = os.path.abspath(__file__)


def hang_on_hang(prompt: str, response: str, task: dict) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0


def raise_on_bad(prompt: str, response: str, task: dict) -> float:
    if response == "bad":
        raise ValueError("bad response")
    if response == "nan":
        return float("nan")
    return 0.25


def die_on_die(prompt: str, response: str, task: dict) -> float:
    if response == "die":
        os._exit(3)
    time.sleep(0.2)  # keep innocent items in flight while the culprit dies
    return float(len(response))


# (response, gold, expected) — fractions, decimals, LaTeX, sets, intervals, GSM8K style.
MATH_ITEMS = [
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 0.5", r"\frac12", 1.0),
    (r"\boxed{0.75}", r"\frac{3}{4}", 1.0),
    (r"\boxed{\frac{2}{3}}", "0.6", 0.0),
    ("#### 42", "42", 1.0),
    ("so 6 * 7 = 42\n#### 41", "42", 0.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{\{1,3\}}", r"\{2,1\}", 0.0),
    (r"\boxed{(0,1]}", "(0,1]", 1.0),
    (r"\boxed{[0,1)}", "(0,1]", 0.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    (r"\boxed{2\sqrt{3}}", r"2\sqrt{2}", 0.0),
    ("The final answer is 12.", "12", 1.0),
    ("answer: 25%", "0.25", 1.0),
    (r"\boxed{x=5}", "5", 1.0),
    (r"\boxed{-3}", "3", 0.0),
    ("", "1", 0.0),
    ("I don't know.", "1", 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"$\boxed{\pi/2}$", r"\frac{\pi}{2}", 1.0),
]


@pytest.fixture(scope="module")
def pool() -> RewardPool:
    # A generous default limit keeps honest items safe on a loaded CI machine; the hang test
    # passes its own short limit.
    with RewardPool(3, timeout_s=30.0, preload=["math"]) as p:
        p.warmup()
        yield p


def test_math_rewards_through_pool(pool: RewardPool) -> None:
    items = [(f"q{i}", r, {"answer": a}) for i, (r, a, _) in enumerate(MATH_ITEMS)]
    result = pool.compute("math", items)
    assert isinstance(result, PoolResult)
    assert result.rewards == [e for _, _, e in MATH_ITEMS]
    assert result.errors == [None] * 20
    assert len(result.seconds) == 20 and all(0.0 <= s < 30.0 for s in result.seconds)
    assert result.restarts == 0
    assert 0.0 < result.wall_s < 60.0


def test_hung_item_times_out_without_stalling(pool: RewardPool) -> None:
    responses = ["a", "b", "hang", "c", "d", "e", "f", "g"]
    t0 = time.perf_counter()
    result = pool.compute(f"{HERE}:hang_on_hang", [("p", r, {}) for r in responses], timeout_s=3.0)
    elapsed = time.perf_counter() - t0
    assert result.rewards == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], result.errors
    assert result.timed_out == [2]
    assert result.failed == [2]
    assert result.errors[2] == "timeout after 3s"
    assert result.seconds[2] == 3.0
    assert result.restarts == 1
    assert elapsed < 60.0  # the 3600 s sleep never blocks the caller
    # the pool is usable again afterwards
    assert pool.compute("math", [("q", r"\boxed{2}", {"answer": "2"})]).rewards == [1.0]


def test_raising_reward_scores_zero_with_reported_error(pool: RewardPool) -> None:
    result = pool.compute(f"{HERE}:raise_on_bad", [("p", r, {}) for r in ["ok", "bad", "ok", "nan"]])
    assert result.rewards == [0.25, 0.0, 0.25, 0.0]
    assert result.errors == [None, "error: ValueError: bad response", None, "error: non-finite reward nan"]
    assert result.failed == [1, 3]
    assert result.timed_out == []
    assert result.restarts == 0


def test_unknown_reward_and_bad_task_are_reported(pool: RewardPool) -> None:
    result = pool.compute("no-such-reward", [("p", "r", {})])
    assert result.rewards == [0.0]
    assert result.errors[0].startswith("error: UnknownRewardError: unknown reward 'no-such-reward'")
    result = pool.compute("math", [("p", r"\boxed{1}", {})])
    assert result.rewards == [0.0]
    assert "task needs an 'answer' field" in result.errors[0]


@pytest.mark.slow
def test_crashed_worker_is_replaced_and_culprit_reported(pool: RewardPool) -> None:
    responses = ["a", "bb", "ccc", "die", "dddd", "eeeee"]
    result = pool.compute(f"{HERE}:die_on_die", [("p", r, {}) for r in responses])
    assert result.rewards == [1.0, 2.0, 3.0, 0.0, 4.0, 5.0], result.errors
    assert result.failed == [3]
    assert result.errors[3].startswith("worker crashed")
    # one crash with several items in flight, then the culprit crashes again when re-run alone
    assert result.restarts == 2
    assert pool.compute(f"{HERE}:die_on_die", [("p", "xy", {})]).rewards == [2.0]


def test_picklable_callable_and_instruction_reward(pool: RewardPool) -> None:
    from k2_rl.rewards.instruction import InstructionReward

    task = {"constraints": [{"type": "no_commas"}, {"type": "word_count", "max": 3}]}
    result = pool.compute(InstructionReward(), [("p", "one two", task), ("p", "one, two, three, four", task)])
    assert result.rewards == [1.0, 0.0]
    assert pool.compute("instruction", [("p", "one, two", task)]).rewards == [0.5]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mp_context"):
        RewardPool(1, mp_context="fork")
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(1, timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardPool(1).compute("math", [], timeout_s=-1)
