"""`kvstore-mcp`: the `kvstore` tasks on the shipped kvstore MCP server, called for real.

One live server (`python -m k2_data.agentic.servers.kvstore`, stdio, through k2-data's
`MCPSession`, as the calculator environment runs its server) serves every episode of the run; each
episode works in a namespace of its own: the environment prefixes the keys of its calls with the
episode's namespace and strips it from the results, so episodes never see or change each other's
keys, and the policy never sees the prefix. The tools are listed from the server itself (same names
and parameters as the `kvstore` simulator's). The initial state is written through `kv_set` at
reset, the final state is read back through `kv_list` and `kv_get`, and the namespace is deleted
when the episode closes. The server is tied to this process (`k2_data.lifetime`).

Tasks, score parts and success are the `kvstore` environment's (k2_rl.envs.kvstore): `state`
against `expected_state`, `calls` against `expected_calls`.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from k2_rl.envs.base import Score, Step, run_calls
from k2_rl.envs.kvstore import heldout_tasks, make_task, real_tool, rename_tools, renamed, score_store
from k2_rl.envs.live import LiveServer, SharedServerMaker


def _listed(text: str) -> list[str]:
    """The keys of a `kv_list` result: one per line, or `{"result": []}` when there are none."""
    if text.startswith("{"):
        return [str(k) for k in json.loads(text).get("result", [])]
    return [k for k in text.split("\n") if k]


class KVStoreMCPEnv:
    def __init__(self, server: LiveServer, namespace: str) -> None:
        self.server, self.ns = server, namespace
        self.task: dict = {}
        self.names: dict[str, str] = {}
        self.made: list[tuple[str, Any, bool]] = []

    # what the policy's calls become on the server, and what it sees of the answers
    def _inward(self, name: str, args: dict) -> dict:
        args = dict(args)
        if name == "kv_list":
            args["prefix"] = self.ns + str(args.get("prefix", ""))
        elif isinstance(args.get("key"), str) and args["key"]:  # "" stays "": the server refuses it
            args["key"] = self.ns + args["key"]
        return args

    def _outward(self, text: str) -> str:
        return text.replace(self.ns, "")

    def reset(self, task: dict) -> tuple[list[dict], list[dict]]:
        if "expected_state" not in task:
            raise ValueError("kvstore task: no field 'expected_state'")
        self.task, self.made = task, []
        self.names = renamed(task)
        for coll, recs in (task.get("initial_state") or {}).items():
            if coll != "kv":
                raise ValueError(
                    f"kvstore-mcp task: initial_state has collection {coll!r}; the server holds 'kv'"
                )
            for key, rec in recs.items():
                self.server.call("kv_set", {"key": self.ns + key, "value": str(rec["value"])})
        return list(task["messages"]), rename_tools(self.server.specs, self.names)

    def step(self, tool_calls: list[dict]) -> Step:
        from k2_data.agentic.mcp_import import MCPToolError

        def call(name: str, args: dict) -> str:
            if (real := real_tool(self.names, name)) is None:
                raise MCPToolError(f"unknown tool {name!r}")
            return self.server.call(real, self._inward(real, args))

        results = run_calls(tool_calls, call, (MCPToolError,), self.made)
        return Step([self._outward(r) for r in results], done=False, state=self.state())

    def state(self) -> dict:
        """The episode's store as the simulator reports one: {"kv": {key: {"key", "value"}}}, {} if empty."""
        keys = _listed(self.server.call("kv_list", {"prefix": self.ns}))
        kv = {}
        for full in keys:
            key = full[len(self.ns) :]
            kv[key] = {"key": key, "value": self.server.call("kv_get", {"key": full})}
        return {"kv": kv} if kv else {}

    def score(self, answer: str) -> Score:
        return score_store(self.state(), self.task, self.made)

    def close(self) -> None:
        for full in _listed(self.server.call("kv_list", {"prefix": self.ns})):
            self.server.call("kv_delete", {"key": full})


class KVStoreMCPMaker(SharedServerMaker):
    name = "kvstore-mcp"
    server_name = "kvstore"

    def __init__(self, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s)
        self._episodes = itertools.count()

    def __call__(self) -> KVStoreMCPEnv:
        return KVStoreMCPEnv(self.live(), f"~ep{next(self._episodes)}~")

    def tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(rng) for _ in range(n)]

    def heldout_tasks(self, n: int, seed: int) -> list[dict]:
        return heldout_tasks(n, seed)
