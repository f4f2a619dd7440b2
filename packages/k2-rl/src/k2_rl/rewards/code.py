"""Code reward: run a program and its assert-based tests in the sandbox; 1.0 only on a clean pass.

The grading protocol (a per-run nonce printed by a non-dumpable notary only after the tests' code
returned, so early exits and printed markers never score) lives in k2-data
(`k2_data.unit_tests`), which the agentic judge's unit-test check shares; its module docstring
says why it is built that way and where it stops.
"""

from __future__ import annotations

import logging

from k2_data.sandbox import SandboxError
from k2_data.unit_tests import last_code_block, run_unit_tests

from k2_rl.rewards.base import BaseReward, register_reward

log = logging.getLogger(__name__)


def code_reward(program: str, tests: str, *, timeout_s: float = 10.0, memory_mb: int = 512) -> float:
    """1.0 when `program` followed by `tests` (plain asserts) runs to the end in the sandbox,
    else 0.0 (failed assert, error, timeout, resource limit, early exit, sandbox violation)."""
    if not isinstance(program, str) or not isinstance(tests, str):
        raise TypeError("code_reward: program and tests must be str")
    try:
        run = run_unit_tests(program, tests, timeout_s=timeout_s, memory_mb=memory_mb)
    except SandboxError as e:
        log.error("code_reward: sandbox failed, scoring 0.0: %s", e)
        return 0.0
    if not run.passed:
        res = run.result
        log.debug(
            "code_reward 0.0: rc=%s killed=%s stderr=%s", res.returncode, res.killed_reason, res.stderr[-500:]
        )
    return 1.0 if run.passed else 0.0


def extract_program(response: str) -> str:
    """The program in a response: its last fenced code block (```python ... ```), else all of it."""
    block = last_code_block(response)
    return block if block is not None else response


@register_reward("code")
class CodeReward(BaseReward):
    """`code_reward` of the response's program against `task["tests"]` (registered as "code")."""

    task_fields = ("tests",)

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 512) -> None:
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def __call__(self, prompt: str, response: str, task: dict) -> float:
        if "tests" not in task:
            raise ValueError("code reward: the task has no field 'tests'")
        return code_reward(
            extract_program(response), task["tests"], timeout_s=self.timeout_s, memory_mb=self.memory_mb
        )
