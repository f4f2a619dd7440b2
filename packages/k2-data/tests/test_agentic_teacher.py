"""The competent scripted teacher (`ScriptedTeacher(follow_requests=True)`): its tasks name concrete calls
in the held-out request style, drawn from other seeds than the held-out tasks; its agent makes exactly
those calls, so its trajectories pass the BFCL-style call check and the tau-style final-state check."""

from __future__ import annotations

import asyncio
import json

from k2_data.agent.client import AsyncHTTPChatClient
from k2_data.agentic.evaluate import evaluate, make_heldout_tasks, score_trajectory
from k2_data.agentic.pipeline import AgenticConfig, run_agentic
from k2_data.agentic.scripted import ScriptedTeacher, concrete_tasks, requested_calls
from k2_data.agentic.state import StateStore, classify
from k2_data.agentic.trajectory import Limits
from k2_data.loopback import LoopbackServer


def _fn(name: str, **props: str) -> dict:
    params = {
        "type": "object",
        "properties": {k: {"type": v} for k, v in props.items()},
        "required": list(props),
    }
    return {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": params},
    }


# a kvstore-like and a notes-like collection plus tools the state store does not model
TOOLS = [
    _fn("kv_set", key="string", value="string"),
    _fn("kv_get", key="string"),
    _fn("kv_delete", key="string"),
    _fn("create_note", title="string", body="string", stars="integer"),
    _fn("update_note", title="string", body="string"),
    _fn("convert", amount="number", unit="string"),
    _fn("ping", loud="boolean"),
]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_requested_calls_parses_the_heldout_request_style():
    tasks = make_heldout_tasks(TOOLS, 6, seed=1)
    for t in tasks:
        want = [(c["name"], c["arguments"]) for c in t["rubric"]["expected_calls"]]
        assert requested_calls(t["user_request"]) == want
    assert requested_calls("call f with {broken. Then call g with {}.") == [("g", {})]


def test_concrete_tasks_reuse_the_heldout_generator_with_other_seeds():
    crud = concrete_tasks(TOOLS, 8, seed=5)
    assert [t["user_request"] for t in crud] == [t["user_request"] for t in make_heldout_tasks(TOOLS, 8, 5)]
    assert all("expected_state" in t["rubric"] for t in crud)
    assert {t["user_request"] for t in crud}.isdisjoint(
        t["user_request"] for t in make_heldout_tasks(TOOLS, 8, 0)
    )
    plain = concrete_tasks([TOOLS[5], TOOLS[6]], 6, seed=5)  # no create in the set: plain calls
    assert all(t["user_request"].startswith("Please call ") for t in plain)
    assert {c["name"] for t in plain for c in t["rubric"]["expected_calls"]} == {"convert", "ping"}
    assert all(
        t["rubric"]["expected_tools"] == [c["name"] for c in t["rubric"]["expected_calls"]] for t in plain
    )


def test_oracle_agent_scores_full_marks_on_heldout_tasks():
    tasks = make_heldout_tasks(TOOLS, 10, seed=7)
    agent = {"id": "eval", "system_prompt": "Do what is asked.", "tools": TOOLS}

    async def run():
        with LoopbackServer(ScriptedTeacher(follow_requests=True)) as server:
            async with AsyncHTTPChatClient(server.base_url) as client:
                return await evaluate(client, "m", agent, tasks)

    result = asyncio.run(run())
    assert result["summary"] == {
        "tasks": 10,
        "bfcl_accuracy": 1.0,
        "call_recall": 1.0,
        "tool_name_recall": 1.0,
        "state_accuracy": 1.0,
    }
    assert all(s["names_matched"] == s["calls_expected"] for s in result["scores"])


def _truth(request: str) -> dict:
    """The task behind a request: its calls, and the state the simulator's store holds after them (a
    collection is modelled once something was created in it; other calls leave no state)."""
    calls = [{"name": n, "arguments": a} for n, a in requested_calls(request)]
    store = StateStore()
    for c in calls:
        op, coll = classify(c["name"]) or (None, None)
        if op == "create" or (op and store.knows(coll)):
            store.apply(op, coll, c["arguments"])
    return {"rubric": {"expected_calls": calls, "expected_state": store.snapshot()}}


def test_pipeline_trajectories_of_the_oracle_pass_both_checks(tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    out = tmp_path / "out"
    with LoopbackServer(ScriptedTeacher(follow_requests=True)) as server:
        cfg = AgenticConfig(
            out=out,
            base_url=server.base_url,
            model="teacher",
            servers=[],
            tool_files=[str(tools)],
            agents=6,
            tasks_per_agent=3,
            tools_per_agent=3,
            concurrency=4,
            heldout=8,
            limits=Limits(edge_rate=0.2),  # transient failures: the agent retries the same call
        )
        summary = run_agentic(cfg)
    trajs = _lines(out / "trajectories.jsonl")
    assert summary["accepted"] == len(trajs) == 18 and summary["tasks_from_llm"] == 18
    assert summary["counters"]["tool_edge_failures"] > 0
    for t in trajs:
        assert requested_calls(t["task"]["user_request"]), t["task"]["user_request"]
        score = score_trajectory(t, _truth(t["task"]["user_request"]))
        assert score["bfcl"] and score["state"], (t["id"], score)
        assert t["messages"][-3]["content"].startswith("Done. ")
    held = summary["heldout"]
    assert (held["bfcl_accuracy"], held["call_recall"], held["state_accuracy"]) == (1.0, 1.0, 1.0)
    # the teacher's tasks come from the per-agent task seeds, never the held-out seed
    heldout = {t["user_request"] for t in _lines(out / "heldout_tasks.jsonl")}
    assert heldout and heldout.isdisjoint(t["user_request"] for t in _lines(out / "tasks.jsonl"))
