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
from k2_data.rephrase.loopback import LoopbackServer

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
