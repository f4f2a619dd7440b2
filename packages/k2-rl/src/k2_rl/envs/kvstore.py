"""`kvstore`: a stateful key-value environment on k2-data's tool simulator (no LLM, no network).

The tools are the shipped kvstore MCP server's (`kv_set`, `kv_get`, `kv_delete`, `kv_list`, same
names and parameters); the calls run on the stateful simulator (`k2_data.agentic.simulator`): the
arguments are validated against the tool's schema, CRUD calls go to its deterministic `StateStore`
(what was set is what a later get returns; a get or delete of an absent key is an error the policy
sees). One store per episode, so episodes never share state.

A task: `{"messages": [...], "initial_state": {"kv": {KEY: {"key", "value"}}}, "expected_state":
{...}, "expected_calls": [{"name", "arguments"}]}` (initial_state and expected_calls optional).
Score parts (tau2-bench style, against the final state): `state` = |records equal| / |records in
either| (1 when both are empty), `calls` (`k2_rl.envs.base.call_score`); success = the final state
equals the expected one and the policy answered.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from k2_rl.envs.base import Score, Step, call_score, combine, run_calls, task_weights

WEIGHTS = {"state": 0.7, "calls": 0.3}


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": props, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_S = {"type": "string"}
TOOLS = [
    _fn(
        "kv_set",
        "Store a value under a key (overwrites an existing one).",
        {"key": _S, "value": _S},
        ["key", "value"],
    ),
    _fn("kv_get", "The value stored under a key; an error if there is none.", {"key": _S}, ["key"]),
    _fn("kv_delete", "Delete a key; an error if there is none.", {"key": _S}, ["key"]),
    _fn("kv_list", "The stored keys that start with a prefix, sorted.", {"prefix": _S}, []),
]


def _records(state: dict) -> set[str]:
    return {
        json.dumps([c, k, r], sort_keys=True) for c, recs in (state or {}).items() for k, r in recs.items()
    }


def state_score(final: dict, expected: dict) -> float:
    a, e = _records(final), _records(expected)
    return 1.0 if not a and not e else len(a & e) / len(a | e)


def score_store(final: dict, task: dict, made: list[tuple[str, Any, bool]]) -> Score:
    """A kvstore episode's score from its final store (the simulator's or the server's) and calls."""
    expected = json.loads(json.dumps(task["expected_state"], sort_keys=True))
    parts = {"state": state_score(final, expected), "calls": call_score(made, task.get("expected_calls"))}
    success = final == {c: r for c, r in expected.items() if r}
    return Score(combine(parts, task_weights(task, WEIGHTS)), success, parts)


class KVStoreEnv:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.sim: Any = None
        self.task: dict = {}
        self.made: list[tuple[str, Any, bool]] = []

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        from k2_data.agentic.simulator import ToolSimulator

        if "expected_state" not in task:
            raise ValueError("kvstore task: no field 'expected_state'")
        self.task, self.made = task, []
        self.sim = ToolSimulator(client=None, model="")
        self.sim.tools(TOOLS)
        self.sim.state.collections["kv"] = {}  # the store exists (empty): a list reads it, not an LLM
        for coll, recs in (task.get("initial_state") or {}).items():
            self.sim.state.collections.setdefault(coll, {}).update({k: dict(r) for k, r in recs.items()})
        return list(task["messages"]), TOOLS

    def step(self, tool_calls: list[dict]) -> Step:
        from k2_data.agentic.simulator import ToolSimError

        def call(name: str, args: dict) -> str:
            return self.loop.run_until_complete(self.sim.call(name, args))

        results = run_calls(tool_calls, call, (ToolSimError,), self.made)
        return Step(results, done=False, state=self.sim.state.snapshot())

    def score(self, answer: str) -> Score:
        return score_store(self.sim.state.snapshot(), self.task, self.made)

    def close(self) -> None:
        self.loop.close()


_KEYS = ["color", "city", "owner", "status", "fruit", "planet", "tool", "animal"]
_VALUES = ["blue", "paris", "ada", "open", "plum", "mars", "saw", "otter", "green", "rome", "kai", "done"]


def make_task(rng: random.Random) -> dict:
    """One generated task: set, update, delete or copy (the last needs a get, then a set)."""
    k1, k2 = rng.sample(_KEYS, 2)
    v1, v2 = rng.sample(_VALUES, 2)
    kind = rng.choice(["set", "update", "delete", "copy"])
    rec = lambda k, v: {"key": k, "value": v}  # noqa: E731
    if kind == "set":
        text, init, exp = f"Store the value '{v1}' under the key '{k1}'.", {}, {k1: rec(k1, v1)}
        calls = [("kv_set", {"key": k1, "value": v1})]
    elif kind == "update":
        text, init = f"Change the value of the key '{k1}' to '{v2}'.", {k1: rec(k1, v1)}
        exp, calls = {k1: rec(k1, v2)}, [("kv_set", {"key": k1, "value": v2})]
    elif kind == "delete":
        text, init = f"Delete the key '{k1}'.", {k1: rec(k1, v1), k2: rec(k2, v2)}
        exp, calls = {k2: rec(k2, v2)}, [("kv_delete", {"key": k1})]
    else:
        text, init = f"Copy the value of the key '{k1}' to the key '{k2}'.", {k1: rec(k1, v1)}
        exp = {k1: rec(k1, v1), k2: rec(k2, v1)}
        calls = [("kv_get", {"key": k1}), ("kv_set", {"key": k2, "value": v1})]
    return {
        "messages": [{"role": "user", "content": text + " Use the tools, then say done."}],
        "initial_state": {"kv": init} if init else {},
        "expected_state": {"kv": exp} if exp else {},
        "expected_calls": [{"name": n, "arguments": a} for n, a in calls],
        "expert_answer": "done",
        "kind": kind,
    }


class KVStoreMaker:
    name = "kvstore"

    def __call__(self) -> KVStoreEnv:
        return KVStoreEnv()

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(rng) for _ in range(n)]

    def close(self) -> None:
        pass
