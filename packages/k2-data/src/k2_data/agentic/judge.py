"""The judge: a trajectory is kept only when it meets its task's rubric.

Deterministic checks first (a failed one rejects without asking the LLM):
- `trainable`: `k2_data.chat.validate_conversation` accepts it (every call answered, arguments a JSON
  object, only declared tools called), so `k2 data sft` will not skip it;
- `final_answer`: it ends with an assistant message with text;
- `expected_tools`: every tool the rubric expects was called at least once without an error;
- `unit_tests` (code tasks whose rubric carries `tests`, plain asserts): the program the conversation
  delivers (the final answer's last fenced code block, else the last `run_python` program that ran
  without error) passes them in the sandbox (`k2_data.unit_tests`, the grader of k2-rl's code reward).
Then the LLM judge rates each success criterion (`{"criteria": [{"criterion", "met": bool}], "verdict":
"accept"|"reject", "reason"}`); kept when the verdict is accept and the share of criteria met is at least
`min_score`. A judge answer without usable JSON rejects.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from k2_data.agentic.llm import ask_json
from k2_data.agentic.user import transcript
from k2_data.chat import validate_conversation

SYSTEM = (
    "You are a strict judge of AI-agent conversations. Given a task, its rubric and the conversation "
    "(tool calls and results included), decide for each success criterion whether it is met. Answer with one "
    'JSON object {"criteria": [{"criterion": <text>, "met": true|false}], "verdict": "accept"|'
    '"reject", "reason": <one sentence>}. Accept only if every criterion is met and the assistant\'s '
    "statements agree with the tool results."
)


def checks(traj: dict[str, Any], rubric: dict[str, Any]) -> dict[str, bool]:
    messages = traj["messages"]
    out: dict[str, bool] = {}
    try:
        validate_conversation(messages, traj["tools"])
        out["trainable"] = True
    except (ValueError, KeyError, TypeError):
        out["trainable"] = False
    last = messages[-1] if messages else {}
    out["final_answer"] = last.get("role") == "assistant" and bool((last.get("content") or "").strip())
    ok_calls = {c["function"]["name"] for c in calls_that_ran(messages)}
    out["expected_tools"] = all(t in ok_calls for t in rubric.get("expected_tools") or [])
    return out


def calls_that_ran(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls of a conversation whose result is not an error, in order."""
    results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    return [
        c
        for m in messages
        for c in m.get("tool_calls") or []
        if (res := results.get(c.get("id"))) is not None
        and not str(res.get("content", "")).startswith("Error:")
    ]


def delivered_program(messages: list[dict[str, Any]]) -> str | None:
    """The program a conversation delivers: the final answer's last fenced code block, else the last
    `run_python` program whose result was not an error (None when there is neither)."""
    from k2_data.agentic.code_tool import CODE_TOOL_NAME
    from k2_data.unit_tests import last_code_block

    last = messages[-1] if messages else {}
    if last.get("role") == "assistant":
        block = last_code_block(last.get("content") or "")
        if block is not None:
            return block
    program = None
    for c in calls_that_ran(messages):
        if c["function"]["name"] == CODE_TOOL_NAME:
            try:
                program = json.loads(c["function"]["arguments"]).get("code")
            except (ValueError, AttributeError):
                continue
    return program if isinstance(program, str) else None


async def unit_test_check(
    traj: dict[str, Any], tests: str, counters: Counter, timeout_s: float = 10.0, memory_mb: int = 256
) -> bool:
    """Whether the delivered program passes `tests` in the sandbox (False without a program, or when the
    sandbox cannot run here: a code task is never kept unchecked)."""
    from k2_data.sandbox import SandboxError
    from k2_data.unit_tests import run_unit_tests

    program = delivered_program(traj["messages"])
    if program is None:
        counters["unit_tests_no_program"] += 1
        return False
    counters["unit_test_runs"] += 1
    try:  # the sandbox blocks on its child: keep the event loop (other trajectories) running
        run = await asyncio.to_thread(
            run_unit_tests, program, tests, timeout_s=timeout_s, memory_mb=memory_mb
        )
    except SandboxError:
        counters["unit_tests_sandbox_unavailable"] += 1
        return False
    counters["unit_tests_passed" if run.passed else "unit_tests_failed"] += 1
    return run.passed


def _full_transcript(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        if m.get("role") == "tool":
            lines.append(f"TOOL RESULT ({m.get('name')}): {str(m.get('content'))[:1000]}")
        elif m.get("role") == "assistant":
            lines.append(transcript([{**m, "tool_calls": None}]))
            for c in m.get("tool_calls") or []:
                lines.append(f"ASSISTANT CALLS {c['function']['name']}({c['function']['arguments']})")
        elif m.get("role") == "user":
            lines.append(f"USER: {m.get('content')}")
    return "\n".join(x for x in lines if x)


async def judge(
    client: Any,
    model: str,
    task: dict[str, Any],
    traj: dict[str, Any],
    seed: int,
    counters: Counter,
    min_score: float = 1.0,
    max_tokens: int = 1024,
) -> dict[str, Any]:
    rubric = task["rubric"]
    result = checks(traj, rubric)
    if rubric.get("tests"):
        result["unit_tests"] = await unit_test_check(traj, rubric["tests"], counters)
    verdict: dict[str, Any] = {"checks": result, "accepted": False, "score": 0.0, "reason": ""}
    failed = [k for k, v in result.items() if not v]
    if failed:
        counters["judge_precheck_rejects"] += 1
        verdict["reason"] = "failed checks: " + ", ".join(failed)
        return verdict
    user = json.dumps(
        {"task": task["user_request"], "goal": task["goal"], "rubric": rubric}, ensure_ascii=False
    )
    answer = await ask_json(
        client,
        model,
        "judge",
        SYSTEM,
        f"{user}\n\nConversation:\n{_full_transcript(traj['messages'])}",
        seed=seed,
        counters=counters,
        temperature=0.0,
        max_tokens=max_tokens,
    )
    if answer is None:
        verdict["reason"] = "judge answer unparsable"
        return verdict
    crit = [c for c in answer.get("criteria") or [] if isinstance(c, dict)]
    score = sum(bool(c.get("met") is True) for c in crit) / max(len(rubric["success_criteria"]), 1)
    verdict["score"] = min(score, 1.0)
    verdict["criteria"] = crit
    verdict["reason"] = str(answer.get("reason") or "")
    verdict["accepted"] = answer.get("verdict") == "accept" and verdict["score"] >= min_score
    return verdict
