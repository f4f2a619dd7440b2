r"""Math reward: 1.0 when the response's final answer equals the reference answer, else 0.0.

Extraction and comparison are done by ``math-verify``:

* **Response.** Parsed with a LaTeX config whose ``\boxed{}`` priority is 0 (highest), then a
  plain-expression config. So a ``\boxed{...}`` answer wins; otherwise math-verify's anchors
  ("final answer is X", "answer: X", "the answer is X") and finally the last number/expression
  in the text. GSM8K's ``#### X`` style is handled first: when the response has no
  ``\boxed`` but has a ``####`` marker, only the rest of the last marker's line is parsed (so
  numbers in a remark after the answer are not mistaken for it). Several different boxed
  answers are read as a set and do not match a single gold value, so hedging scores 0.
* **Gold.** Reference answers are usually bare LaTeX (``\frac{1}{2}``, ``(0, 1]``,
  ``\{1,2\}``) or plain numbers; a bare answer is wrapped in ``$...$`` so math-verify reads it
  as LaTeX.
* **Equivalence.** ``math_verify.verify(gold, pred)``: numeric (``1/2 == 0.5 == 50%``),
  symbolic (``\sqrt{2}/2 == \frac{\sqrt2}{2}``), sets, intervals, ``x = 3`` vs ``3``.

math-verify bounds its parsing and comparison with ``signal.alarm``, which only works in the
main thread: from another thread ``parse`` raises and ``verify`` silently returns False. So
:func:`math_reward` refuses to run off the main thread with timeouts on (it raises instead of
returning a wrong 0.0). Compute rewards in worker processes (:class:`RewardPool`, whose
workers run each item on their main thread) or pass ``timeout_s=None`` and bound the time
yourself.
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from k2_rl.rewards.base import BaseReward, register_reward

__all__ = ["MathReward", "extract_answer", "math_reward"]

_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_GSM8K_MARKER = re.compile(r"####\s*")


def _check_thread(timeout_s: int | None) -> None:
    if timeout_s is not None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "math_reward: math-verify's timeouts use signal.alarm, which only works in the main thread "
            "(off it, parse raises and verify silently returns False). Compute math rewards in worker "
            "processes (k2_rl.rewards.pool.RewardPool) or pass timeout_s=None and bound the time yourself."
        )


def _response_text(response: str) -> str:
    if "\\boxed" not in response:
        markers = list(_GSM8K_MARKER.finditer(response))
        if markers:
            return response[markers[-1].end() :].split("\n", 1)[0]
    return response


def _parse_gold(answer: str, timeout_s: int | None) -> list:
    text = answer.strip()
    if "$" not in text and "\\boxed" not in text:
        text = f"${text}$"
    return parse(text, parsing_timeout=timeout_s)  # type: ignore[arg-type]


def extract_answer(response: str, *, timeout_s: int | None = 5) -> list:
    """The parsed final answer(s) of ``response`` as math-verify returns them (empty if none)."""
    _check_thread(timeout_s)
    return parse(_response_text(response), extraction_config=_PRED_CONFIG, parsing_timeout=timeout_s)  # type: ignore[arg-type]


def math_reward(response: str, answer: str, *, timeout_s: int | None = 5) -> float:
    """1.0 if the final answer of ``response`` is equivalent to the gold ``answer``, else 0.0.

    ``timeout_s`` bounds each math-verify parse/compare (whole seconds, signal based; main
    thread only, see the module docstring). An empty response, an answer that cannot be
    extracted or a timeout scores 0.0.
    """
    _check_thread(timeout_s)
    if not response.strip():
        return 0.0
    gold = _parse_gold(str(answer), timeout_s)
    if not gold:
        raise ValueError(f"math_reward: could not parse the gold answer {answer!r}")
    pred = extract_answer(response, timeout_s=timeout_s)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0


@register_reward("math")
class MathReward(BaseReward):
    """Registry adapter: ``task["answer"]`` is the gold answer."""

    name = "math"

    def __init__(self, timeout_s: int | None = 5) -> None:
        self.timeout_s = timeout_s

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        if "answer" not in task:
            raise ValueError(f"reward 'math': task needs an 'answer' field, got keys {sorted(task)}")
        return math_reward(response, task["answer"], timeout_s=self.timeout_s)
