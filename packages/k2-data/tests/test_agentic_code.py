"""The code tool runs for real in k2_data.sandbox inside trajectories: what the agent sees is what Python
printed; a failing, looping or memory-hungry program is a tool error, and the tool simulator is never
asked about it."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest
from k2_data.agentic.code_tool import CODE_TOOL_NAME, CodeExecError, CodeExecutor
from k2_data.agentic.pipeline import AgenticConfig, run_agentic
from k2_data.agentic.scripted import ScriptedTeacher
from k2_data.agentic.trajectory import Limits
from k2_data.loopback import LoopbackServer

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux"),
    pytest.mark.skipif(os.geteuid() != 0, reason="full containment needs root (uid drop, namespaces)"),
]


def test_code_executor_runs_programs_in_the_sandbox():
    ex = CodeExecutor(timeout_s=2, memory_mb=128)
    tool = ex.tool()
    assert tool.name == CODE_TOOL_NAME and tool.parameters["required"] == ["code"]

    async def run(code):
        return await tool.fn(code=code)

    assert asyncio.run(run("print(6 * 7)")) == "42\n"
    # its own uid, not root, and no network (an empty network namespace)
    probe = (
        "import os, socket\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1); net = 'net'\n"
        "except OSError:\n    net = 'no-net'\n"
        "print(os.getuid() != 0, net)"
    )
    assert asyncio.run(run(probe)).split() == ["True", "no-net"]
    for code, message in (
        ("import sys; print('partial'); sys.exit(3)", "exit status 3"),
        ("while True: pass", "limit and was killed"),
        ("x = bytearray(1 << 30)", "128 MB memory limit"),
        ("raise ValueError('bad input')", "ValueError: bad input"),
    ):
        with pytest.raises(CodeExecError, match=message):
            asyncio.run(run(code))
    assert [c["ok"] for c in ex.calls] == [True, True, False, False, False, False]
    assert ex.counters["code_calls"] == 6 and ex.counters["code_errors"] == 4


PLAN = [
    (CODE_TOOL_NAME, {"code": "print(sum(range(10)))"}),
    (CODE_TOOL_NAME, {"code": "import sys; sys.exit(3)"}),
]


def test_code_tool_calls_in_trajectories_run_for_real(tmp_path):
    cfg = AgenticConfig(
        out=tmp_path / "out",
        base_url="",
        model="teacher",
        servers=[],
        code_tool=True,
        agents=1,
        tasks_per_agent=2,
        tools_per_agent=1,
        concurrency=2,
        limits=Limits(edge_rate=0.0, max_steps=4),
        coverage=False,
    )
    with LoopbackServer(ScriptedTeacher(plan=PLAN)) as server:
        cfg.base_url = server.base_url
        summary = run_agentic(cfg)
        stages = [r["messages"][0]["content"] for r in server.requests]
    assert not any("[k2-agentic/tool-simulator]" in s for s in stages)  # nothing simulated
    # the task writer of an agent holding the code tool is asked for unit tests
    assert any(s.startswith("[k2-agentic/tasks]") and "The agent can run Python" in s for s in stages)
    repo = [json.loads(line) for line in (tmp_path / "out" / "tools.jsonl").read_text().splitlines()]
    assert [(r["spec"]["function"]["name"], r["source"]) for r in repo] == [(CODE_TOOL_NAME, "sandbox")]
    trajs = [json.loads(line) for line in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajs) == 2
    for t in trajs:
        results = [m["content"] for m in t["messages"] if m["role"] == "tool"]
        assert results[0] == "45\n"  # Python's answer, not a simulated one
        assert results[1].startswith("Error:") and "exit status 3" in results[1]
        assert [c["ok"] for c in t["code_calls"]] == [True, False]
    assert summary["sandboxed_code_calls"] == 4 and summary["counters"]["code_errors"] == 2


def _call(i: int, code: str) -> dict:
    args = json.dumps({"code": code})
    return {"id": f"c{i}", "type": "function", "function": {"name": CODE_TOOL_NAME, "arguments": args}}


def _code_traj(programs_ok: list[tuple[str, bool]], final: str) -> dict:
    """A conversation whose agent ran `programs_ok` (program, whether its result was a success) in turn."""
    from k2_data.agentic.code_tool import CODE_TOOL_SPEC

    messages = [{"role": "user", "content": "Write slug(s) and run it."}]
    for i, (code, ok) in enumerate(programs_ok):
        messages.append({"role": "assistant", "content": None, "tool_calls": [_call(i, code)]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok\n" if ok else "Error: boom"})
    messages.append({"role": "assistant", "content": final})
    return {"messages": messages, "tools": [CODE_TOOL_SPEC]}


GOOD = "def slug(s):\n    return '-'.join(s.lower().split())\nprint(slug('A B'))"
WRONG = "def slug(s):\n    return s.lower()\n"
TESTS = "assert slug('Hello World') == 'hello-world'\nassert slug('x') == 'x'\n"


def test_delivered_program_is_the_final_code_block_else_the_last_good_run():
    from k2_data.agentic.judge import delivered_program

    # the last run that did not error, not the failing one after it
    assert (
        delivered_program(_code_traj([(WRONG, True), (GOOD, True), ("1/0", False)], "Done.")["messages"])
        == GOOD
    )
    # a fenced block in the final answer is what the user receives: it wins
    final = f"Here it is:\n```python\n{WRONG}```"
    assert delivered_program(_code_traj([(GOOD, True)], final)["messages"]) == WRONG
    assert delivered_program(_code_traj([("1/0", False)], "Sorry.")["messages"]) is None


def test_code_task_rubric_tests_run_against_the_delivered_program(tmp_path):
    """A code task is kept only when the delivered program passes the rubric's tests in the sandbox; a
    failing or early-exiting program is rejected before the LLM judge is asked."""
    from collections import Counter

    from k2_data.agent.client import AsyncHTTPChatClient
    from k2_data.agentic.judge import judge

    task = {
        "user_request": "Write slug(s).",
        "goal": "a slug function",
        "rubric": {"success_criteria": ["slug works"], "expected_tools": [CODE_TOOL_NAME], "tests": TESTS},
    }
    cases = {
        "good": _code_traj([(GOOD, True)], "Done."),
        "wrong": _code_traj([(WRONG, True)], "Done."),
        "early exit": _code_traj([("import sys\nsys.exit(0)", True)], "Done."),
        "no program": _code_traj([("1/0", False)], "Sorry, it failed."),
    }
    counters: Counter = Counter()

    async def go(base_url):
        async with AsyncHTTPChatClient(base_url, cache=tmp_path / "cache.sqlite") as client:
            return {
                k: await judge(client, "teacher", task, t, seed=0, counters=counters)
                for k, t in cases.items()
            }

    with LoopbackServer(ScriptedTeacher()) as server:
        verdicts = asyncio.run(go(server.base_url))
        judge_requests = len(server.requests)
    assert verdicts["good"]["checks"]["unit_tests"] is True and verdicts["good"]["accepted"] is True
    for k in ("wrong", "early exit", "no program"):
        v = verdicts[k]
        assert v["accepted"] is False and v["checks"].get("unit_tests") is False, k
        assert "unit_tests" in v["reason"], k
    assert judge_requests == 1  # only the passing trajectory reached the LLM judge
    assert counters["unit_tests_passed"] == 1 and counters["unit_tests_failed"] == 2
    assert counters["unit_tests_no_program"] == 1


def test_code_tasks_ask_for_tests_and_keep_only_valid_ones():
    from collections import Counter

    from k2_data.agentic.generate import _clean_task

    raw = {
        "user_request": "Write slug(s).",
        "rubric": {
            "success_criteria": ["works"],
            "expected_tools": [CODE_TOOL_NAME],
            "tests": ["assert 1", "assert 2"],
        },
    }
    counters: Counter = Counter()
    kept = _clean_task(raw, {CODE_TOOL_NAME}, counters)
    assert kept["rubric"]["tests"] == "assert 1\nassert 2\n"
    # an agent without the code tool: tests are not kept (nothing could run them)
    assert "tests" not in _clean_task(raw, {"other"}, counters)["rubric"]
    bad = {**raw, "rubric": {**raw["rubric"], "tests": "assert slug('a' =="}}
    assert "tests" not in _clean_task(bad, {CODE_TOOL_NAME}, counters)["rubric"]
    assert counters["task_tests_invalid"] == 1
