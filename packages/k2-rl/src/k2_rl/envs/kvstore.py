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

Generated tasks (`make_task`, `heldout_tasks`): keys and values are words of the shipped list
(kvstore_words.txt), split by hash into a training and a held-out pool; training tasks take the
first, held-out tasks the second, with new compositions of the calls and renamed tools as columns
of their own (task field `split`). A task's optional `tool_names` ({real: shown}) renames tools.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import random
from pathlib import Path
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


def renamed(task: dict) -> dict[str, str]:
    """The task's `tool_names` ({real name: shown name}), checked: the policy sees and calls the
    shown names, the store runs the real ones (the held-out "unseen tools" column)."""
    names = task.get("tool_names") or {}
    real = {t["function"]["name"] for t in TOOLS}
    if not isinstance(names, dict) or not set(names) <= real or len(set(names.values())) != len(names):
        raise ValueError(f"kvstore task field 'tool_names' must map some of {sorted(real)} to distinct names")
    return {str(k): str(v) for k, v in names.items()}


def real_tool(names: dict[str, str], shown: str) -> str | None:
    """The real name behind the name the policy called, None when the task hides it (a renamed
    task's real names are hidden too); every name is real when the task renames nothing."""
    if not names:
        return shown
    return {v: k for k, v in names.items()}.get(shown)


def rename_tools(tools: list[dict], names: dict[str, str]) -> list[dict]:
    out = []
    for t in tools:
        fn = t["function"]
        out.append({**t, "function": {**fn, "name": names.get(fn["name"], fn["name"])}})
    return out


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
        self.names: dict[str, str] = {}
        self.made: list[tuple[str, Any, bool]] = []

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        from k2_data.agentic.simulator import ToolSimulator

        if "expected_state" not in task:
            raise ValueError("kvstore task: no field 'expected_state'")
        self.task, self.made = task, []
        self.names = renamed(task)
        self.sim = ToolSimulator(client=None, model="")
        self.sim.tools(TOOLS)
        self.sim.state.collections["kv"] = {}  # the store exists (empty): a list reads it, not an LLM
        for coll, recs in (task.get("initial_state") or {}).items():
            self.sim.state.collections.setdefault(coll, {}).update({k: dict(r) for k, r in recs.items()})
        return list(task["messages"]), rename_tools(TOOLS, self.names)

    def step(self, tool_calls: list[dict]) -> Step:
        from k2_data.agentic.simulator import ToolSimError

        def call(name: str, args: dict) -> str:
            if (real := real_tool(self.names, name)) is None:
                raise ToolSimError(f"unknown tool {name!r}")
            return self.loop.run_until_complete(self.sim.call(real, args))

        results = run_calls(tool_calls, call, (ToolSimError,), self.made)
        return Step(results, done=False, state=self.sim.state.snapshot())

    def score(self, answer: str) -> Score:
        return score_store(self.sim.state.snapshot(), self.task, self.made)

    def close(self) -> None:
        self.loop.close()


@functools.cache
def words() -> tuple[str, ...]:
    """The shipped word list (kvstore_words.txt): the keys and values of generated tasks."""
    text = (Path(__file__).parent / "kvstore_words.txt").read_text()
    return tuple(w for w in (line.strip() for line in text.splitlines()) if w and not w.startswith("#"))


def word_pool(word: str) -> str:
    """The pool of `word`: "heldout" for the ~20% of words whose SHA-256 starts below 0x33, else
    "train"; a fixed, content-based split, so no held-out key or value can be in a training task."""
    return "heldout" if hashlib.sha256(word.encode()).digest()[0] < 0x33 else "train"


@functools.cache
def pool(name: str) -> tuple[str, ...]:
    if name not in ("train", "heldout"):
        raise ValueError(f"kvstore word pool must be 'train' or 'heldout', got {name!r}")
    return tuple(w for w in words() if word_pool(w) == name)


# Task kinds. Training tasks (SFT and RL) use TRAIN_KINDS; held-out tasks add compositions of the
# same calls that no training task shows (NEW_KINDS). Every kind changes the store, so an agent that
# calls nothing never succeeds.
TRAIN_KINDS = ("set", "update", "delete", "copy")
NEW_KINDS = ("move", "set_two", "replace")

# Tool names of the "unseen tools" held-out column: the same store behind names never trained on.
RENAMED_TOOLS = {
    "kv_set": "store_put",
    "kv_get": "store_fetch",
    "kv_delete": "store_remove",
    "kv_list": "store_keys",
}


def make_task(
    rng: random.Random,
    kinds: tuple[str, ...] = TRAIN_KINDS,
    words_from: str = "train",
    tool_names: dict[str, str] | None = None,
) -> dict:
    """One generated task of a kind drawn from `kinds`, its keys and values from the word pool
    `words_from`. The request names keys and values in double quotes, keys first, as the call's JSON
    arguments do. The kinds: set, update, delete, copy (a get, then a set), and for held-out only
    move (copy, then delete the source), set_two (two sets) and replace (a delete and a set)."""
    k1, k2 = rng.sample(pool(words_from), 2)
    v1, v2 = rng.sample(pool(words_from), 2)
    kind = rng.choice(kinds)
    rec = lambda k, v: {"key": k, "value": v}  # noqa: E731
    if kind == "set":
        text, init, exp = f'Set the key "{k1}" to the value "{v1}".', {}, {k1: rec(k1, v1)}
        calls = [("kv_set", {"key": k1, "value": v1})]
    elif kind == "update":
        text, init = f'Change the key "{k1}" to the value "{v2}".', {k1: rec(k1, v1)}
        exp, calls = {k1: rec(k1, v2)}, [("kv_set", {"key": k1, "value": v2})]
    elif kind == "delete":
        text, init = f'Delete the key "{k1}".', {k1: rec(k1, v1), k2: rec(k2, v2)}
        exp, calls = {k2: rec(k2, v2)}, [("kv_delete", {"key": k1})]
    elif kind == "copy":
        text, init = f'Copy the value of the key "{k1}" to the key "{k2}".', {k1: rec(k1, v1)}
        exp = {k1: rec(k1, v1), k2: rec(k2, v1)}
        calls = [("kv_get", {"key": k1}), ("kv_set", {"key": k2, "value": v1})]
    elif kind == "move":
        text, init = f'Move the value of the key "{k1}" to the key "{k2}".', {k1: rec(k1, v1)}
        exp = {k2: rec(k2, v1)}
        calls = [("kv_get", {"key": k1}), ("kv_set", {"key": k2, "value": v1}), ("kv_delete", {"key": k1})]
    elif kind == "set_two":
        text = f'Set the key "{k1}" to the value "{v1}" and the key "{k2}" to the value "{v2}".'
        init, exp = {}, {k1: rec(k1, v1), k2: rec(k2, v2)}
        calls = [("kv_set", {"key": k1, "value": v1}), ("kv_set", {"key": k2, "value": v2})]
    elif kind == "replace":
        text = f'Delete the key "{k1}", then set the key "{k2}" to the value "{v2}".'
        init, exp = {k1: rec(k1, v1)}, {k2: rec(k2, v2)}
        calls = [("kv_delete", {"key": k1}), ("kv_set", {"key": k2, "value": v2})]
    else:
        raise ValueError(f"unknown kvstore task kind {kind!r}; known: {', '.join(TRAIN_KINDS + NEW_KINDS)}")
    names = tool_names or {}
    task = {
        "messages": [{"role": "user", "content": text + " Use the tools, then say done."}],
        "initial_state": {"kv": init} if init else {},
        "expected_state": {"kv": exp} if exp else {},
        "expected_calls": [{"name": names.get(n, n), "arguments": a} for n, a in calls],
        "expert_answer": "done",
        "kind": kind,
    }
    if tool_names:
        task["tool_names"] = dict(tool_names)
    return task


def heldout_tasks(n: int, seed: int) -> list[dict]:
    """`n` held-out tasks, every key and value from the held-out word pool, in three equal columns
    (task field `split`): `values` (the training kinds), `compositions` (NEW_KINDS) and `tools` (the
    training kinds behind RENAMED_TOOLS)."""
    rng = random.Random(seed)
    splits = [
        ("values", TRAIN_KINDS, None),
        ("compositions", NEW_KINDS, None),
        ("tools", TRAIN_KINDS, RENAMED_TOOLS),
    ]
    out = []
    for i in range(n):
        split, kinds, names = splits[i % len(splits)]
        out.append({**make_task(rng, kinds, "heldout", names), "split": split})
    return out


class KVStoreMaker:
    name = "kvstore"

    def __call__(self) -> KVStoreEnv:
        return KVStoreEnv()

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(rng) for _ in range(n)]

    def heldout_tasks(self, n: int, seed: int) -> list[dict]:
        return heldout_tasks(n, seed)

    def close(self) -> None:
        pass
