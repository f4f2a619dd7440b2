"""Real MCP tools execute for real inside trajectories: the shipped kvstore server answers the agent's
calls (not the simulator), timeouts and server errors reach the agent as tool errors, and resume replays
real calls on fresh servers without touching the LLM request cache."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap

import pytest
from k2_data.agentic.pipeline import AgenticConfig, run_agentic
from k2_data.agentic.scripted import ScriptedTeacher
from k2_data.agentic.trajectory import Limits
from k2_data.loopback import LoopbackServer

pytest.importorskip("mcp")

PLAN = [
    ("kv_set", {"key": "city", "value": "Paris"}),
    ("kv_get", {"key": "city"}),
    ("kv_get", {"key": "nowhere"}),
]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _config(out, base_url, **kw):
    return AgenticConfig(
        out=out,
        base_url=base_url,
        model="teacher",
        servers=["kvstore"],
        agents=1,
        tasks_per_agent=2,
        tools_per_agent=4,
        concurrency=2,
        limits=Limits(edge_rate=0.0, max_steps=6),
        **kw,
    )


def test_mcp_tools_run_on_the_real_server_inside_trajectories(tmp_path):
    with LoopbackServer(ScriptedTeacher(plan=PLAN)) as server:
        summary = run_agentic(_config(tmp_path / "out", server.base_url))
        stages = [r["messages"][0]["content"] for r in server.requests]
    assert not any("[k2-agentic/tool-simulator]" in s for s in stages)  # nothing simulated
    trajs = _lines(tmp_path / "out" / "trajectories.jsonl")
    assert len(trajs) == 2
    for t in trajs:
        results = [m["content"] for m in t["messages"] if m["role"] == "tool"]
        # the server's own replies: a simulated kv_set would answer {"status": "created", ...}
        assert results[:2] == ["created city", "Paris"]
        assert results[2].startswith("Error:") and "no such key: nowhere" in results[2]
        assert [(c["tool"], c["ok"]) for c in t["mcp_calls"]] == [
            ("kv_set", True),
            ("kv_get", True),
            ("kv_get", False),
        ]
        assert t["state"] == {}  # the simulator's store was never used
    # each trajectory had its own server: the second one's kv_set created the key again (no leak)
    assert summary["real_mcp_calls"] == 6 and summary["counters"]["mcp_sessions"] == 2
    assert summary["counters"]["mcp_tool_errors"] == 2 and "tool_calls" not in summary["counters"]
    repo = _lines(tmp_path / "out" / "tools.jsonl")
    assert {r["server"] for r in repo} == {"kvstore"}

    # resume: the trajectories are done, nothing is rerun (no server starts, no request)
    with LoopbackServer(ScriptedTeacher(plan=PLAN)) as server:
        again = run_agentic(_config(tmp_path / "out", server.base_url))
        assert len(server.requests) == 0
    assert again["trajectories_this_run"] == 0 and "mcp_sessions" not in again["counters"]

    # an interrupted run replays from the cache: drop the ledger; real calls run again on fresh servers,
    # give the same replies, so every LLM request is a cache hit
    (tmp_path / "out" / "trajectories.jsonl").unlink()
    (tmp_path / "out" / "sft.jsonl").unlink()
    with LoopbackServer(ScriptedTeacher(plan=PLAN)) as server:
        replay = run_agentic(_config(tmp_path / "out", server.base_url))
        assert len(server.requests) == 0
    assert (
        replay["counters"]["mcp_calls"] == 6 and replay["client"]["cache_hits"] == replay["client"]["calls"]
    )
    replayed = {t["id"]: t["messages"] for t in _lines(tmp_path / "out" / "trajectories.jsonl")}
    assert replayed == {t["id"]: t["messages"] for t in trajs}


SLOW_SERVER = textwrap.dedent(
    """
    import time
    from k2_data.agentic.servers._base import make_server, tool_error

    server = make_server("slow", "A slow and a failing tool.")

    @server.tool()
    def slow_echo(text: str) -> str:
        \"\"\"Echo text after a long pause.\"\"\"
        time.sleep(30)
        return text

    @server.tool()
    def fast_echo(text: str) -> str:
        \"\"\"Echo text at once.\"\"\"
        return text

    if __name__ == "__main__":
        server.run("stdio")
    """
)


def test_real_call_timeouts_and_dead_servers_are_tool_errors(tmp_path):
    from k2_data.agentic.execute import MCPExecError, MCPExecutor
    from k2_data.agentic.mcp_import import ServerSpec, server_spec

    script = tmp_path / "slow_server.py"
    script.write_text(SLOW_SERVER)

    async def go():
        servers = {
            "slow": server_spec(f"{sys.executable} {script}"),
            "ghost": ServerSpec("ghost", sys.executable, ["-c", "import sys; sys.exit(3)"]),
        }
        async with MCPExecutor(servers, timeout_s=1.0, start_timeout_s=30.0) as ex:
            with pytest.raises(MCPExecError, match="slow_echo timed out after 1 s"):
                await ex.call("slow", "slow_echo", {"text": "hi"})
            fast = await ex.call("slow", "fast_echo", {"text": "still alive"})  # the session survives
            with pytest.raises(MCPExecError, match="MCP server ghost unavailable"):
                await ex.call("ghost", "anything", {})
            with pytest.raises(MCPExecError, match="MCP server ghost unavailable"):  # not restarted
                await ex.call("ghost", "anything", {})
            return fast, dict(ex.counters), ex.calls

    fast, counters, calls = asyncio.run(go())
    assert fast == "still alive"
    assert counters["mcp_timeouts"] == 1 and counters["mcp_start_failures"] == 1
    assert [c["ok"] for c in calls] == [False, True, False, False]
