"""Held-out synthetic tasks: BFCL-style AST checks of calls and tau-style final-state checks, scored on
rollouts of a scripted exact agent (all pass) and a scripted sloppy one (wrong argument: both fail)."""

from __future__ import annotations

import asyncio
import json
import re

from k2_data.agent.client import AsyncHTTPChatClient
from k2_data.agentic.evaluate import ast_match, evaluate, make_heldout_tasks, state_match
from k2_data.agentic.scripted import ScriptedTeacher, tool_call_response
from k2_data.loopback import LoopbackServer, Reply

NOTES = [
    {"type": "function", "function": {"name": n, "description": d, "parameters": p}}
    for n, d, p in [
        (
            "create_note",
            "Create a note.",
            {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "body": {"type": "string"},
                    "stars": {"type": "integer"},
                },
                "required": ["title", "body", "stars"],
            },
        ),
        (
            "update_note",
            "Edit a note.",
            {
                "type": "object",
                "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                "required": ["title", "body"],
            },
        ),
        (
            "delete_note",
            "Delete a note.",
            {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]},
        ),
        (
            "summarize",
            "Summarize text.",
            {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        ),
    ]
]


def test_ast_match_follows_bfcl():
    exp = {"name": "f", "arguments": {"a": 2, "b": {"any_of": ["x", "y"]}, "c": {"any_of": ["", True]}}}
    assert ast_match({"name": "f", "arguments": '{"a": 2.0, "b": "y"}'}, exp)  # c may be omitted
    assert ast_match({"function": {"name": "f", "arguments": {"a": 2, "b": "x", "c": True}}}, exp)
    assert not ast_match({"name": "g", "arguments": '{"a": 2, "b": "x"}'}, exp)  # name
    assert not ast_match({"name": "f", "arguments": '{"a": 3, "b": "x"}'}, exp)  # value
    assert not ast_match({"name": "f", "arguments": '{"a": true, "b": "x"}'}, exp)  # bool is not a number
    assert not ast_match({"name": "f", "arguments": '{"b": "x"}'}, exp)  # required a missing
    assert not ast_match({"name": "f", "arguments": '{"a": 2, "b": "x", "d": 1}'}, exp)  # unexpected d
    assert not ast_match({"name": "f", "arguments": '{"a": 2, "b": '}, exp)  # not JSON


def test_state_match_is_exact():
    s = {"note": {"t": {"title": "t", "stars": 2}}}
    assert state_match(s, {"note": {"t": {"title": "t", "stars": 2.0}}}) == (True, [])
    ok, diff = state_match(s, {"note": {"t": {"title": "t", "stars": 3}}, "event": {"e": {}}})
    assert not ok and len(diff) == 2 and diff[0] == "event/e: missing"


def _agent(sloppy: bool):
    """Does exactly what the request says (sloppy: the first string argument is altered)."""

    def respond(request):
        msgs = request["messages"]
        if not request.get("tools"):
            return ScriptedTeacher()(request)
        planned = [
            (n, json.loads(a)) for n, a in re.findall(r"call (\w+) with (\{.*?\})\.", msgs[1]["content"])
        ]
        done = sum(len(m.get("tool_calls") or []) for m in msgs if m["role"] == "assistant")
        if done < len(planned):
            name, args = planned[done]
            if sloppy and done == 0:
                k = next(k for k, v in args.items() if isinstance(v, str) and k != "title")
                args = {**args, k: args[k] + " (edited)"}
            return Reply(body=tool_call_response([(name, json.dumps(args))], start=done))
        return Reply(content="All done.")

    return respond


def test_heldout_tasks_scored_by_calls_and_final_state(tmp_path):
    tasks = make_heldout_tasks(NOTES, 6, seed=3)
    assert len(tasks) == 6 and all(t["rubric"]["expected_calls"][0]["name"] == "create_note" for t in tasks)
    assert any(len(t["rubric"]["expected_calls"]) == 2 for t in tasks)
    deleted = [t for t in tasks if t["rubric"]["expected_calls"][-1]["name"] == "delete_note"]
    assert all(t["rubric"]["expected_state"] == {} for t in deleted)
    agent = {"id": "eval", "system_prompt": "Do what is asked.", "tools": NOTES}

    async def run(sloppy):
        with LoopbackServer(_agent(sloppy)) as server:
            async with AsyncHTTPChatClient(server.base_url) as client:
                return await evaluate(client, "m", agent, tasks)

    good = asyncio.run(run(False))
    assert good["summary"] == {
        "tasks": 6,
        "bfcl_accuracy": 1.0,
        "call_recall": 1.0,
        "tool_name_recall": 1.0,
        "state_accuracy": 1.0,
    }
    bad = asyncio.run(run(True))
    assert bad["summary"]["bfcl_accuracy"] == 0.0
    # every tool was the right one, one argument per task was not: names 100%, calls short of it
    assert bad["summary"]["tool_name_recall"] == 1.0 and bad["summary"]["call_recall"] < 1.0
    # a sloppy create is overwritten by a later update or erased by a delete: the state can still match
    ok_state = sum(s["state"] for s in bad["scores"])
    creates_only = sum(len(t["rubric"]["expected_calls"]) == 1 for t in tasks)
    assert bad["summary"]["state_accuracy"] < 1.0 and ok_state <= len(tasks) - creates_only
    assert all(s["diff"] for s, t in zip(bad["scores"], tasks) if len(t["rubric"]["expected_calls"]) == 1)


def test_cli_heldout_scores_an_endpoint_before_and_after(tmp_path):
    """`--eval-only --heldout N`: tasks built once over the repository's CRUD tools and read back, so a
    second endpoint (a student after SFT) is scored on the same tasks; no request cache between them."""
    from k2_data.agentic.cli import main

    tools = tmp_path / "notes.json"
    tools.write_text(json.dumps(NOTES))
    out = tmp_path / "agentic"
    scores = {}
    for name, sloppy in (("before", True), ("after", False)):
        with LoopbackServer(_agent(sloppy)) as server:
            argv = ["--out", str(out), "--base-url", server.base_url, "--model", "m", "--no-mcp"]
            argv += ["--tools-json", str(tools), "--eval-only", "--heldout", "5"]
            argv += ["--scores-file", str(tmp_path / f"{name}.json")]
            assert main(argv) == 0
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    tasks = [json.loads(line) for line in (out / "heldout_tasks.jsonl").read_text().splitlines()]
    assert len(tasks) == 5 and [s["id"] for s in scores["after"]["scores"]] == [t["id"] for t in tasks]
    assert scores["before"]["summary"]["bfcl_accuracy"] == 0.0
    assert scores["after"]["summary"]["bfcl_accuracy"] == 1.0
    assert scores["after"]["summary"]["state_accuracy"] == 1.0
    assert not (out / "trajectories.jsonl").exists()  # eval-only generates nothing else
    # a tool set without a CRUD create is refused by name
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([NOTES[-1]]))
    argv = ["--out", str(tmp_path / "x"), "--base-url", "http://127.0.0.1:9", "--model", "m", "--no-mcp"]
    assert main(argv + ["--tools-json", str(plain), "--eval-only", "--heldout", "3"]) == 1
