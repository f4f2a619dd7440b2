"""math_reward: answer extraction and symbolic equivalence via math-verify, plus the registry adapter."""

from __future__ import annotations

import threading

import pytest
from k2_rl.rewards.base import BaseReward, budget_penalty, get_reward, list_rewards, register_reward
from k2_rl.rewards.math import MathReward, extract_answer, math_reward


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        # \boxed{} is preferred, fractions vs decimals both ways
        (r"Adding the halves gives \boxed{\frac{1}{2}}.", "0.5", 1.0),
        ("The answer is 0.5", r"\frac{1}{2}", 1.0),
        ("the answer is 1/2.", "0.5", 1.0),
        (r"so $x = \boxed{\sqrt{2}/2}$", r"\frac{\sqrt2}{2}", 1.0),
        (r"The answer is $3\pi$", r"3\pi", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),
        (r"\boxed{1,234}", "1234", 1.0),
        ("The final answer is 12.", "12", 1.0),
        ("answer: 50%", "0.5", 1.0),
        # sets and intervals
        (r"\boxed{\{1, 2, 3\}}", r"\{3,2,1\}", 1.0),
        (r"\boxed{(0, 1]}", "(0,1]", 1.0),
        (r"\boxed{[0, 1]}", "(0,1]", 0.0),
        # GSM8K "#### X": the number after the marker, not a later remark
        ("3 apples and 4 pears make 7.\n#### 7", "7", 1.0),
        ("#### 7\nI checked it 3 times.", "7", 1.0),
        ("#### 7\nI checked it 3 times.", "3", 0.0),
        # the last boxed answer wins over an earlier one; hedging with several boxes fails
        (r"First I got \boxed{3} but actually \boxed{4}", "4", 1.0),
        (r"\boxed{1}\boxed{2}\boxed{3}", "2", 0.0),
        # boxed beats a later stray number
        (r"\boxed{5} (that took 2 steps)", "5", 1.0),
        # wrong and missing answers
        (r"\boxed{2}", "3", 0.0),
        ("", "3", 0.0),
        ("no numbers here", "3", 0.0),
    ],
)
def test_math_reward(response: str, answer: str, expected: float) -> None:
    assert math_reward(response, answer) == expected


def test_extract_answer_prefers_boxed() -> None:
    parsed = extract_answer(r"We try 7 then 8; \boxed{\frac{3}{4}} and finally 9")
    assert str(parsed[0]) == "3/4"


def test_bad_gold_answer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="gold answer"):
        math_reward(r"\boxed{1}", "")


def test_math_reward_refuses_non_main_thread() -> None:
    """math-verify's signal timeouts break off the main thread: raise instead of a silent 0.0."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = math_reward(r"\boxed{\frac12}", "0.5")
        except RuntimeError as exc:
            out["error"] = str(exc)
        out["no_timeout"] = math_reward(r"\boxed{\frac12}", "0.5", timeout_s=None)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert "value" not in out
    assert "main thread" in str(out["error"])
    assert out["no_timeout"] == 1.0


def test_registry_math_adapter() -> None:
    reward = get_reward("math")
    assert isinstance(reward, MathReward)
    assert reward.name == "math"
    assert reward("What is 1/4 + 1/4?", r"\boxed{0.5}", {"answer": r"\frac12"}) == 1.0
    assert reward("What is 1/4 + 1/4?", r"\boxed{0.25}", {"answer": r"\frac12"}) == 0.0
    with pytest.raises(ValueError, match="'answer'"):
        reward("q", "1", {})
    assert {"math", "instruction"} <= set(list_rewards())


def test_register_and_import_specs() -> None:
    @register_reward("test-length")
    class LengthReward(BaseReward):
        def __call__(self, prompt: str, response: str, task: dict) -> float:
            return min(len(response) / 10, 1.0)

    r = get_reward("test-length")
    assert r.name == "test-length"
    assert r("", "abcde", {}) == 0.5
    with pytest.raises(ValueError, match="already registered"):

        @register_reward("test-length")
        def other(prompt: str, response: str, task: dict) -> float:
            return 0.0

    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        get_reward("nope")
    assert get_reward("k2_rl.rewards.math:math_reward") is math_reward
    fn = get_reward(f"{__file__}:_spec_reward")
    assert fn("", "xyz", {}) == 3.0


def _spec_reward(prompt: str, response: str, task: dict) -> float:
    return float(len(response))


@pytest.mark.parametrize(
    ("reward", "truncated", "penalty", "replace", "expected"),
    [
        (1.0, False, 0.5, False, 1.0),
        (1.0, True, 0.5, False, 0.5),
        (0.0, True, 0.25, False, -0.25),
        (1.0, True, 0.3, True, -0.3),
        (0.7, False, 0.3, True, 0.7),
    ],
)
def test_budget_penalty(
    reward: float, truncated: bool, penalty: float, replace: bool, expected: float
) -> None:
    assert budget_penalty(reward, truncated, penalty, replace=replace) == pytest.approx(expected)


def test_budget_penalty_rejects_negative() -> None:
    with pytest.raises(ValueError, match="penalty must be >= 0"):
        budget_penalty(1.0, True, -0.1)
