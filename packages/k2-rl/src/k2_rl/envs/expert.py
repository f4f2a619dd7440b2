"""Expert episodes and task files for an environment: SFT data that teaches a policy the call format
before RL, and the RL and held-out task files.

    python -m k2_rl.envs.expert --env kvstore --out DIR [--sft 400 --tasks 64 --heldout 32 --seed 0]
        [--requests 1]

writes DIR/sft.jsonl (chat records `{messages, tools}` for `k2 sft --data`; with `--requests K`
each record is one conversation of K tasks, a user turn each), DIR/tasks.jsonl and
DIR/heldout.jsonl (for `k2 rl --env NAME --tasks ... --heldout ...`), each from its own seed; the
held-out tasks are the environment's `heldout_tasks` where it has them (kvstore: keys and values from
a hash-disjoint word pool, new compositions of calls, renamed tools). An
expert episode makes the task's `expert_calls` (else its `expected_calls`) one per assistant turn,
through the environment itself (the tool turns hold the environment's real results), then answers
`expert_answer`; a record is kept only when the environment scores it a strict success.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def expert_episode(maker: Any, task: dict, first_call: int = 0) -> dict | None:
    """The expert's conversation `{messages, tools}` for `task`, or None when it does not succeed.
    Its calls are numbered from `first_call` (the Kimi call ids count across a conversation)."""
    env = maker()
    try:
        messages, tools = env.reset(task)
        messages = list(messages)
        for i, c in enumerate(task.get("expert_calls") or task.get("expected_calls") or [], start=first_call):
            call = {
                "id": f"functions.{c['name']}:{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            (result,) = env.step([call]).results
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "name": c["name"], "content": result}
            )
        answer = str(task.get("expert_answer", ""))
        messages.append({"role": "assistant", "content": answer})
        return {"messages": messages, "tools": tools} if env.score(answer).success else None
    finally:
        env.close()


def expert_conversation(maker: Any, tasks: list[dict]) -> dict | None:
    """One conversation that takes `tasks` one after another (a user turn, the expert's calls and
    answer, the next user turn, ...), each task in an environment of its own; None unless every
    task succeeds. More requests per conversation put more trained argument values next to one
    system prompt of tool schemas (the part of a record that is not trained)."""
    messages: list[dict] = []
    tools: list[dict] = []
    for task in tasks:
        n_calls = sum(len(m.get("tool_calls") or []) for m in messages)
        rec = expert_episode(maker, task, first_call=n_calls)
        if rec is None or (tools and rec["tools"] != tools):
            return None
        messages += rec["messages"]
        tools = rec["tools"]
    return {"messages": messages, "tools": tools}


def heldout_tasks(maker: Any, n: int, seed: int) -> list[dict]:
    """The maker's held-out tasks (`heldout_tasks(n, seed)`: values and compositions no training
    task has), or, for an environment without that method, more of its generated tasks."""
    make = getattr(maker, "heldout_tasks", None)
    return make(n, seed) if make is not None else maker.tasks(n, seed)


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)


def write_env_data(
    env: str, out: str | Path, sft: int, tasks: int, heldout: int, seed: int = 0, requests: int = 1
) -> dict[str, int]:
    """The three files (see the module); each SFT record takes `requests` tasks in one conversation."""
    from k2_rl.envs import get_env

    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    out, maker = Path(out), get_env(env)
    try:
        pool = maker.tasks(sft * requests, seed + 1000)
        groups = [pool[i : i + requests] for i in range(0, len(pool), requests)]
        records = [r for g in groups if (r := expert_conversation(maker, g)) is not None]
        _write(out / "sft.jsonl", records)
        _write(out / "tasks.jsonl", maker.tasks(tasks, seed))
        _write(out / "heldout.jsonl", heldout_tasks(maker, heldout, seed + 1))
    finally:
        maker.close()
    return {"sft": len(records), "tasks": tasks, "heldout": heldout}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m k2_rl.envs.expert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="kvstore, kvstore-mcp, calculator or python")
    ap.add_argument("--out", required=True, help="directory for sft.jsonl, tasks.jsonl, heldout.jsonl")
    ap.add_argument("--sft", type=int, default=400, help="expert SFT conversations to generate")
    ap.add_argument("--tasks", type=int, default=64, help="RL tasks")
    ap.add_argument("--heldout", type=int, default=32, help="held-out tasks")
    ap.add_argument(
        "--requests", type=int, default=1, help="tasks per SFT conversation, one user turn each (default 1)"
    )
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    n = write_env_data(a.env, a.out, a.sft, a.tasks, a.heldout, a.seed, a.requests)
    print(f"{a.out}: {n['sft']} expert episodes, {n['tasks']} tasks, {n['heldout']} held-out tasks ({a.env})")


if __name__ == "__main__":
    main()
