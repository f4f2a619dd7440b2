"""The agentic pipeline end to end against a scripted OpenAI-protocol teacher on loopback: malformed
tool calls, invalid arguments, tool errors, a judge that rejects, a judge without JSON; SFT output that
`k2 data sft` reads; a killed run that resumes without duplicates."""

from __future__ import annotations

import json

import pytest
from k2_data.agentic.cli import main as agentic_main
from k2_data.agentic.pipeline import AgenticConfig, run_agentic
from k2_data.agentic.scripted import ScriptedTeacher
from k2_data.agentic.trajectory import Limits
from k2_data.examples.tooluse import TOOLS
from k2_data.loopback import LoopbackServer, Reply
from k2_data.sft import conversation_of, tokenize_chat

MARKERS = ["", "MALFORMED", "INVALID", "UNKNOWN", "REJECT", "GARBLED"]
# marker -> (accepted, why)
EXPECTED = {
    "": (True, "scripted"),
    "MALFORMED": (False, "failed checks: trainable"),
    "INVALID": (True, "scripted"),  # the schema error is answered, the agent retries validly
    "UNKNOWN": (False, "failed checks: trainable"),
    "REJECT": (False, "scripted"),
    "GARBLED": (False, "judge answer unparsable"),
}


def _config(tmp_path, base_url, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    kw = {"agents": 2, "tasks_per_agent": 6, "concurrency": 4, **kw}
    return AgenticConfig(
        out=tmp_path / "out",
        base_url=base_url,
        model="teacher",
        servers=[],
        tool_files=[str(tools)],
        limits=Limits(edge_rate=0.0),
        **kw,
    )


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def _marker(rec):
    first = rec["task"]["user_request"].split()[0]
    return first if first in MARKERS else ""


def test_pipeline_keeps_exactly_the_trajectories_that_meet_their_rubric(tmp_path):
    with LoopbackServer(ScriptedTeacher(MARKERS)) as server:
        summary = run_agentic(_config(tmp_path, server.base_url))
        judged = sum("[k2-agentic/judge]" in r["messages"][0]["content"] for r in server.requests)
    out = tmp_path / "out"
    trajs = _lines(out / "trajectories.jsonl")
    assert len(trajs) == 12 and len({t["id"] for t in trajs}) == 12
    for t in trajs:
        accepted, why = EXPECTED[_marker(t)]
        assert t["verdict"]["accepted"] is accepted, (t["id"], t["verdict"])
        assert t["verdict"]["reason"].startswith(why)
        assert t["turns"] == 2 and t["stop_reason"] == "user_done"
    invalid = next(t for t in trajs if _marker(t) == "INVALID")
    assert "invalid arguments for" in invalid["tool_errors"][0]
    malformed = next(t for t in trajs if _marker(t) == "MALFORMED")
    assert "not valid JSON" in malformed["tool_errors"][0]
    # the rubric kept only tool names of the set; prechecks skip the LLM judge (4 of 12 failed them), and
    # a judge answer without JSON is re-asked once with the next seed (2 GARBLED trajectories)
    assert all(t["task"]["rubric"]["expected_tools"] == [t["tools"][0]["function"]["name"]] for t in trajs)
    assert judged == 12 - 4 + 2
    assert summary["accepted"] == 4 and summary["acceptance_rate"] == pytest.approx(4 / 12)
    assert summary["tools"] == 4 and summary["agents_from_llm"] == 2 and summary["tasks_from_llm"] == 12

    sft = _lines(out / "sft.jsonl")
    assert sorted(r["id"] for r in sft) == sorted(t["id"] for t in trajs if t["verdict"]["accepted"])
    for rec in sft:
        messages, tools = conversation_of(rec)  # validate_conversation passes
        assert any(m.get("tool_calls") for m in messages) and tools
    manifest = tokenize_chat([out / "sft.jsonl"], tmp_path / "shards")
    assert manifest["num_docs"] == 4 and manifest["num_skipped"] == 0 and manifest["num_trained_tokens"] > 0


def test_a_killed_run_resumes_without_duplicates_and_without_paying_twice(tmp_path):
    with LoopbackServer(ScriptedTeacher(MARKERS)) as server:
        clean = run_agentic(_config(tmp_path / "clean", server.base_url, concurrency=2))
    reference = {t["id"]: t for t in _lines(tmp_path / "clean" / "out" / "trajectories.jsonl")}

    teacher = ScriptedTeacher(MARKERS)
    budget = {"n": 45}

    def dying(request):  # the endpoint dies after 45 requests: the run is cut mid-trajectory
        budget["n"] -= 1
        if budget["n"] < 0:
            return Reply(status=400, body={"error": {"message": "gone"}})
        return teacher(request)

    cfg = _config(tmp_path, "", concurrency=2)
    with LoopbackServer(dying) as server:
        cfg.base_url = server.base_url
        with pytest.raises(Exception, match="gone"):
            run_agentic(cfg)
    out = tmp_path / "out"
    partial = _lines(out / "trajectories.jsonl")
    assert 0 < len(partial) < 12
    with open(out / "trajectories.jsonl", "ab") as f:  # and a torn line, as a kill mid-write leaves
        f.write(b'{"id": "a0000-t0')

    with LoopbackServer(ScriptedTeacher(MARKERS)) as server:
        cfg.base_url = server.base_url
        resumed = run_agentic(cfg)
        sent = len(server.requests)
    trajs = _lines(out / "trajectories.jsonl")
    assert len(trajs) == 12 and len({t["id"] for t in trajs}) == 12
    assert resumed["trajectories_this_run"] == 12 - len(partial)
    assert resumed["client"]["cache_hits"] > 0  # agents, tasks and the cut trajectories' turns
    assert sent < clean["client"]["http_requests"]
    for t in trajs:  # the same trajectories as an uninterrupted run
        assert t["messages"] == reference[t["id"]]["messages"]
        assert t["verdict"]["accepted"] == reference[t["id"]]["verdict"]["accepted"]
    sft = _lines(out / "sft.jsonl")
    assert len(sft) == len({r["id"] for r in sft}) == resumed["accepted"] == clean["accepted"]

    with LoopbackServer(ScriptedTeacher(MARKERS)) as server:  # a finished run does nothing new
        cfg.base_url = server.base_url
        again = run_agentic(cfg)
        assert again["trajectories_this_run"] == 0 and again["client"]["http_requests"] == 0


def test_cli_runs_the_pipeline(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    with LoopbackServer(ScriptedTeacher()) as server:
        rc = agentic_main(
            [
                "--out",
                str(tmp_path / "o"),
                "--base-url",
                server.base_url,
                "--model",
                "t",
                "--no-mcp",
                "--tools-json",
                str(tools),
                "--agents",
                "1",
                "--tasks-per-agent",
                "2",
                "--edge-rate",
                "0",
            ]
        )
    assert rc == 0
    assert "4 tools (json:tools 4), 1 agents, 2 tasks, 2 trajectories (2 this run), 2 accepted" in (
        capsys.readouterr().out
    )
    assert len(_lines(tmp_path / "o" / "sft.jsonl")) == 2


def test_cli_fails_when_the_server_refuses_every_request(tmp_path, capsys):
    """A wrong --model (404 on every request) ends in exit 1 with the server's error, and the CLI
    does not suggest `k2 data sft` on the empty sft.jsonl."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))

    def refuse(request: dict) -> Reply:
        return Reply(status=404, body={"error": {"message": f"model {request['model']!r} does not exist"}})

    with LoopbackServer(refuse) as server:
        argv = ["--out", str(tmp_path / "o"), "--base-url", server.base_url, "--model", "wrongname"]
        rc = agentic_main(
            [*argv, "--no-mcp", "--tools-json", str(tools), "--agents", "1", "--tasks-per-agent", "2"]
        )
    out, err = capsys.readouterr()
    assert rc == 1, out + err
    assert "HTTP 404" in err and "wrongname" in err and "does not exist" in err
    assert "k2 data sft" not in out and not (tmp_path / "o" / "sft.jsonl").exists()
