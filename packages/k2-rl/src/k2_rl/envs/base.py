"""The environment interface of `k2 rl --env`, its scores and the combination rule.

An environment runs one episode: `reset(task)` gives the opening messages and the tools the policy
may call; `step(tool_calls)` runs one assistant turn's calls (OpenAI-shaped, as
`k2_data.chat.parse_tool_calls` returns them) and gives one result text per call, whether the
environment ended the episode, and its state; `score(answer)` scores the finished episode (the final
answer is the last assistant turn's content, "" when it never answered). `close()` frees what the
episode held. One instance serves one episode; `EnvMaker` makes them (and owns what episodes share,
such as a live MCP server).

A tool that fails is not an environment failure: its error text is the call's result (`Error: ...`),
and it counts against call correctness. An environment that raises, hangs past `env_timeout_s` or
returns malformed results ends its episode with a logged error and reward 0 (k2_rl.episodes).

The combination rule (`combine`): an episode's reward is a weighted mean of its parts,

    reward = sum_k w_k * part_k / sum_k w_k        (parts in [0, 1])

with default weights per environment (state 0.7 + calls 0.3 for a stateful tool environment;
answer 0.7 + calls 0.3 for the calculator; tests 0.8 + calls 0.2 for code) and a task's own
`"reward_weights"` overriding them. Strict success (`success`) is logged beside this partial credit:
the final state equals the expected one (or the answer, or every unit test passed) and the policy
answered within its budget.

Open tasks (a task with `"rubrics"`, or `"reward": "rubric"`) are also scored by the self-critique
rubric reward (k2_rl.rewards.rubric): the critic compares the final answers of the task's K
episodes pairwise, and each episode's win rate joins its parts as `rubric`, with weight
`"rubric_weight"` (default 1) against the environment's parts taken together (weight 1):

    reward = (env_reward + w_rubric * rubric) / (1 + w_rubric)      (`with_rubric`)

Strict success stays the environment's: a rubric cannot make an episode succeed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Step:
    results: list[str]  # one text per call, in call order
    done: bool = False  # the environment ended the episode
    state: Any = None  # what the environment exposes of its state (logged)


@dataclass
class Score:
    reward: float  # partial credit in [0, 1], by `combine`
    success: bool  # strict success
    parts: dict[str, float] = field(default_factory=dict)


class Environment(Protocol):
    def reset(self, task: dict) -> tuple[list[dict], list[dict]]: ...

    def step(self, tool_calls: list[dict]) -> Step: ...

    def score(self, answer: str) -> Score: ...

    def close(self) -> None: ...


class EnvMaker(Protocol):
    """Makes one `Environment` per episode; `tasks(n, seed)` gives generated tasks when no
    `--tasks` file is given; `close()` stops what the episodes shared."""

    name: str

    def __call__(self) -> Environment: ...

    def tasks(self, n: int, seed: int) -> list[dict]: ...

    def close(self) -> None: ...


def combine(parts: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """The documented rule: the weighted mean of the parts named in `weights` (see the module)."""
    missing = sorted(set(weights) - set(parts))
    if missing:
        raise ValueError(f"reward_weights name parts this environment does not score: {', '.join(missing)}")
    total = sum(float(w) for w in weights.values())
    if total <= 0:
        raise ValueError(f"reward_weights must sum to > 0, got {dict(weights)}")
    return sum(float(w) * float(parts[k]) for k, w in weights.items()) / total


def is_open_task(task: Mapping[str, Any]) -> bool:
    """A task the rubric reward scores too (see the module): it names rubrics or the rubric reward."""
    return bool(task.get("rubrics")) or task.get("reward") == "rubric"


def rubric_weight(task: Mapping[str, Any]) -> float:
    w = task.get("rubric_weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
        raise ValueError(f"task field 'rubric_weight' must be a number >= 0, got {w!r}")
    return float(w)


def with_rubric(env_reward: float, rubric: float, weight: float) -> float:
    """The documented rule for open tasks: the environment's reward and the rubric win rate,
    weighted 1 : `weight`."""
    return (float(env_reward) + weight * float(rubric)) / (1.0 + weight)


def run_calls(
    tool_calls: Sequence[Mapping[str, Any]],
    call: Callable[[str, dict], str],
    errors: tuple[type[BaseException], ...],
    made: list[tuple[str, Any, bool]],
) -> list[str]:
    """One result text per call: `call(name, arguments)`, or `Error: ...` when the arguments are not
    a JSON object or `call` raises one of `errors` (a tool failing is the policy's problem, not the
    environment's). Each call is appended to `made` as (name, arguments or None, succeeded)."""
    results = []
    for c in tool_calls:
        try:
            name, args = function_call(c)
            text, ok = call(name, args), True
        except (*errors, ValueError) as e:
            name, args, text, ok = str((c.get("function") or {}).get("name")), None, f"Error: {e}", False
        made.append((name, args, ok))
        results.append(text)
    return results


def task_weights(task: dict, default: Mapping[str, float]) -> dict[str, float]:
    w = task.get("reward_weights")
    if w is None:
        return dict(default)
    if not isinstance(w, dict) or not all(isinstance(v, (int, float)) for v in w.values()):
        raise ValueError(f"task field 'reward_weights' must map part names to numbers, got {w!r}")
    return {str(k): float(v) for k, v in w.items()}


def canonical_call(name: str, arguments: Any) -> str:
    """One call as a comparable string (arguments parsed and key-sorted)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return f"{name}:{json.dumps(arguments, sort_keys=True, ensure_ascii=False)}"


def call_score(made: Sequence[tuple[str, Any, bool]], expected: Sequence[Mapping[str, Any]] | None) -> float:
    """Call correctness in [0, 1]. `made`: (name, arguments, succeeded) per call. With the task's
    `expected_calls` ([{name, arguments}]): F1 between the successful calls and the expected ones
    (multisets of canonical calls); without: the fraction of calls that succeeded, 0 with no calls."""
    if expected is None:
        return sum(ok for *_, ok in made) / len(made) if made else 0.0
    got = Counter(canonical_call(n, a) for n, a, ok in made if ok)
    want = Counter(canonical_call(c["name"], c.get("arguments", {})) for c in expected)
    if not got and not want:
        return 1.0
    hit = sum((got & want).values())
    if hit == 0:
        return 0.0
    p, r = hit / sum(got.values()), hit / sum(want.values())
    return 2 * p * r / (p + r)


def function_call(call: Mapping[str, Any]) -> tuple[str, dict]:
    """(name, arguments dict) of an OpenAI-shaped call; ValueError when the arguments are not an object."""
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    args = json.loads(args) if isinstance(args, str) else args
    if not isinstance(args, dict):
        raise ValueError("arguments are not a JSON object")
    return str(fn.get("name")), args


__all__ = [
    "EnvMaker",
    "Environment",
    "Score",
    "Step",
    "call_score",
    "canonical_call",
    "combine",
    "function_call",
    "is_open_task",
    "rubric_weight",
    "run_calls",
    "task_weights",
    "with_rubric",
]
