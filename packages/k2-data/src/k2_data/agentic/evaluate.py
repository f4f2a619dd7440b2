"""Held-out synthetic tasks scored two ways: BFCL-style argument checks and tau-style final-state checks.

A held-out task carries ground truth in its rubric: `expected_calls` (`[{"name", "arguments"}]`) and
`expected_state` (the tool simulator's `StateStore.snapshot()` after those calls, computed by running them
on a fresh store, so the truth is the world model's own, not an LLM's guess).

- `ast_match(call, expected)`: BFCL's AST check, on JSON: same function name, the arguments parse to a JSON
  object, no parameter the expectation does not list, every listed one present with an acceptable value.
  An expected value is a value or `{"any_of": [v, ...]}`; `""` among the choices means the parameter may
  be omitted (BFCL's possible-answer convention). Numbers compare by value (2 == 2.0, not True), strings
  exactly after stripping, lists in order, objects key by key.
- `state_match(state, expected)`: tau-bench's check: the final state equals the expected one exactly (every
  collection, every record); the differences are listed.
- `score_trajectory(traj, task)` -> `{"calls_matched", "names_matched", "calls_expected", "bfcl", "state",
  "diff"}` (`names_matched`: expected calls whose tool name was called, arguments aside);
  `bfcl` is True when every expected call is matched by a distinct actual call that ran (order-free,
  extra calls allowed: reads before writes are fine), `state` when the final state matches.
- `make_heldout_tasks(specs, n, seed)`: tasks from the CRUD tools of a tool set (a create, optionally
  followed by an update or delete of the same record), with explicit arguments in the request;
  `evaluate(...)` rolls them out with the agent and the simulator and aggregates
  (`bfcl_accuracy`, `state_accuracy`, `call_recall`, `tool_name_recall`).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from typing import Any

from k2_data.agentic.state import StateError, StateStore, classify

OMIT = ""


def _norm(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        return v.strip()
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    return v


def _same(a: Any, b: Any) -> bool:
    na, nb = _norm(a), _norm(b)
    return type(na) is type(nb) and na == nb


def _choices(expected: Any) -> list[Any]:
    return (
        list(expected["any_of"]) if isinstance(expected, dict) and set(expected) == {"any_of"} else [expected]
    )


def ast_match(call: dict[str, Any], expected: dict[str, Any]) -> bool:
    """`call`: `{"name", "arguments": str | dict}` or an OpenAI `tool_calls` entry."""
    fn = call.get("function", call)
    if fn.get("name") != expected["name"]:
        return False
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return False
    if not isinstance(args, dict):
        return False
    want = expected.get("arguments") or {}
    if set(args) - set(want):
        return False
    for param, exp in want.items():
        choices = _choices(exp)
        if param not in args:
            if OMIT not in choices:
                return False
            continue
        cands = [c for c in choices if not (isinstance(exp, dict) and c == OMIT)]
        if not any(_same(args[param], c) for c in cands):
            return False
    return True


def state_match(state: dict[str, Any], expected: dict[str, Any]) -> tuple[bool, list[str]]:
    diffs = []
    for coll in sorted(set(state) | set(expected)):
        have, want = state.get(coll) or {}, expected.get(coll) or {}
        for key in sorted(set(have) | set(want)):
            if key not in have:
                diffs.append(f"{coll}/{key}: missing")
            elif key not in want:
                diffs.append(f"{coll}/{key}: unexpected")
            elif not _same(have[key], want[key]):
                diffs.append(f"{coll}/{key}: {json.dumps(have[key])} != {json.dumps(want[key])}")
    return not diffs, diffs


def calls_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls that ran without an error (their result did not start with `Error:`)."""
    results = {m.get("tool_call_id"): str(m.get("content", "")) for m in messages if m.get("role") == "tool"}
    return [
        c["function"]
        for m in messages
        if m.get("role") == "assistant"
        for c in m.get("tool_calls") or []
        if c.get("id") in results and not results[c["id"]].startswith("Error:")
    ]


def score_trajectory(traj: dict[str, Any], task: dict[str, Any]) -> dict[str, Any]:
    rubric = task["rubric"]
    calls, expected = calls_of(traj["messages"]), rubric.get("expected_calls") or []
    used: set[int] = set()
    matched = 0
    for exp in expected:
        j = next((i for i, c in enumerate(calls) if i not in used and ast_match(c, exp)), None)
        if j is not None:
            used.add(j)
            matched += 1
    # the right tool names whatever the arguments: what a student learns before copying values
    named = Counter(e["name"] for e in expected) & Counter(c.get("name") for c in calls)
    out: dict[str, Any] = {
        "calls_matched": matched,
        "names_matched": sum(named.values()),
        "calls_expected": len(expected),
        "bfcl": matched == len(expected),
    }
    if "expected_state" in rubric:
        ok, diff = state_match(traj.get("state") or {}, rubric["expected_state"])
        out.update(state=ok, diff=diff)
    return out


def _value(name: str, schema: dict[str, Any], rng: random.Random) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(1, 9)
    if kind == "number":
        return rng.randint(10, 99) / 2
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(name, schema.get("items") or {"type": "string"}, rng) for _ in range(2)]
    return f"{name}-{rng.randint(100, 999)}"


def _args(fn: dict[str, Any], rng: random.Random, fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    out = {k: _value(k, props[k], rng) for k in params.get("required", list(props)) if k in props}
    for k, v in (fixed or {}).items():
        if k in props:
            out[k] = v
    return out


def call_request(calls: list[dict[str, Any]]) -> str:
    """The user request naming `calls` in order: "Please call NAME with {json}. Then call ..."."""
    request = " Then ".join(f"call {c['name']} with {json.dumps(c['arguments'])}." for c in calls)
    return f"Please {request[0].lower()}{request[1:]}"


def calls_task(calls: list[dict[str, Any]], expected_state: dict[str, Any] | None = None) -> dict[str, Any]:
    """A task whose request names `calls`, its rubric holding them (and the state they leave, if known)."""
    rubric: dict[str, Any] = {
        "success_criteria": [f"{c['name']} is called with the given arguments" for c in calls],
        "expected_tools": [c["name"] for c in calls],
        "checkpoints": [],
        "expected_calls": calls,
    }
    if expected_state is not None:
        rubric["expected_state"] = expected_state
    return {
        "user_request": call_request(calls),
        "goal": "the world state after exactly these calls",
        "rubric": rubric,
    }


def make_heldout_tasks(
    specs: list[dict[str, Any]], n: int, seed: int = 0, prefix: str = "heldout"
) -> list[dict]:
    """Up to `n` tasks over the CRUD tools in `specs`, each with `expected_calls` and `expected_state`."""
    rng = random.Random(seed)
    fns = [s["function"] for s in specs]
    by = {}
    for fn in fns:
        kind = classify(fn["name"])
        if kind is not None:
            by.setdefault(kind[1], {}).setdefault(kind[0], fn)
    colls = sorted(c for c, ops in by.items() if "create" in ops)
    tasks = []
    for i in range(n if colls else 0):
        coll = colls[i % len(colls)]
        ops = by[coll]
        create = ops["create"]
        calls = [{"name": create["name"], "arguments": _args(create, rng)}]
        follow = [op for op in ("update", "delete") if op in ops]
        store = StateStore()
        key = None
        try:
            key = store.apply("create", coll, calls[0]["arguments"])["id"]
            if follow and rng.random() < 0.7:
                op = rng.choice(follow)
                fn = ops[op]
                keyed = {f: v for f, v in calls[0]["arguments"].items() if store.key_of(coll, {f: v}) == key}
                args = _args(fn, rng, keyed)
                store.apply(op, coll, args)
                calls.append({"name": fn["name"], "arguments": args})
        except StateError:  # a tool set the store cannot key: keep the create only
            store = StateStore()
            store.apply("create", coll, calls[0]["arguments"])
            calls = calls[:1]
        tasks.append({"id": f"{prefix}-{i:03d}", **calls_task(calls, store.snapshot()), "heldout": True})
    return tasks


def aggregate(scores: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(scores)
    with_state = [s for s in scores if "state" in s]
    return {
        "tasks": n,
        "bfcl_accuracy": sum(s["bfcl"] for s in scores) / n if n else 0.0,
        "call_recall": sum(s["calls_matched"] for s in scores)
        / max(sum(s["calls_expected"] for s in scores), 1),
        # the right tools whatever their arguments: what a student learns before copying values
        "tool_name_recall": sum(s.get("names_matched", 0) for s in scores)
        / max(sum(s["calls_expected"] for s in scores), 1),
        "state_accuracy": sum(s["state"] for s in with_state) / len(with_state) if with_state else 0.0,
    }


async def evaluate(
    client: Any,
    model: str,
    agent: dict[str, Any],
    tasks: list[dict[str, Any]],
    limits: Any = None,
    seed: int = 0,
    concurrency: int = 4,
) -> dict[str, Any]:
    """Roll each held-out task out (the agent on `client`, greedy; the stateful simulator, no edge
    failures) and score it; `{"summary": aggregate, "scores": [...]}`."""
    from dataclasses import replace

    from k2_data.agentic.trajectory import Limits, rollout

    # greedy and without injected failures: a score is a property of the model, not of a draw
    limits = replace(limits or Limits(max_turns=1), edge_rate=0.0, temperature=0.0)
    gate = asyncio.Semaphore(concurrency)
    counters: Counter = Counter()

    async def one(i: int, task: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            traj = await rollout(client, model, agent, task, seed * 100_003 + i, limits, counters)
        return {"id": task["id"], **score_trajectory(traj, task)}

    scores = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    return {"summary": aggregate(list(scores)), "scores": list(scores)}
