"""Tool environments for multi-turn `k2 rl --env NAME` episodes (k2_rl.episodes runs them).

Shipped: `kvstore` (the stateful tool simulator with the kvstore server's tools), `kvstore-mcp`
(the same tasks on the shipped kvstore MCP server, called for real, a namespace per episode),
`calculator` (the shipped calculator MCP server, called for real), `python` (k2-data's sandbox as the tool, unit tests
as the reward). Your own: `--env package.module:attr` or `--env path/to/file.py:attr`, an `EnvMaker`
(a class is instantiated with no arguments); see `k2_rl.envs.base` for the interface and the
reward combination rule.
"""

from __future__ import annotations

from typing import Any

from k2_rl.envs.base import Environment, EnvMaker, Score, Step, call_score, combine

SHIPPED = ("kvstore", "kvstore-mcp", "calculator", "python")


def env_known(name: str) -> bool:
    return name in SHIPPED or ":" in name


def get_env(name: str) -> Any:
    """The `EnvMaker` named `name` (shipped, or an import spec as for rewards)."""
    if name == "kvstore":
        from k2_rl.envs.kvstore import KVStoreMaker

        return KVStoreMaker()
    if name == "kvstore-mcp":
        from k2_rl.envs.kvstore_mcp import KVStoreMCPMaker

        return KVStoreMCPMaker()
    if name == "calculator":
        from k2_rl.envs.calculator import CalculatorMaker

        return CalculatorMaker()
    if name == "python":
        from k2_rl.envs.python import PythonMaker

        return PythonMaker()
    if ":" in name:
        from k2_rl.rewards.base import _load_spec

        obj = _load_spec(name)
        return obj() if isinstance(obj, type) else obj
    raise ValueError(f"unknown environment {name!r}; shipped: {', '.join(SHIPPED)}, or MODULE:NAME")


__all__ = [
    "SHIPPED",
    "EnvMaker",
    "Environment",
    "Score",
    "Step",
    "call_score",
    "combine",
    "env_known",
    "get_env",
]
