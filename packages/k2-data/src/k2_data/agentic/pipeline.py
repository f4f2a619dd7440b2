"""`k2 data agentic`: tool repository -> agents -> tasks with rubrics -> trajectories -> judge -> SFT data.

    summary = run_agentic(AgenticConfig(out=Path("out"), base_url="http://127.0.0.1:8000/v1", model="k2"))

OUT gets `tools.jsonl` (the repository), `agents.jsonl`, `tasks.jsonl`, `trajectories.jsonl` (every
trajectory with its judge verdict), `sft.jsonl` (the kept ones as `{"id", "messages", "tools"}`, which
`k2 data sft` tokenizes with loss masks) and `summary.json`. Every LLM call goes through one
`AsyncHTTPChatClient` with a persistent request cache (`OUT/.k2-agentic/cache.sqlite`) and bounded
concurrency. Resumable: the repository is imported once; agents and tasks are regenerated from the cache;
a trajectory already in `trajectories.jsonl` is skipped, one a kill interrupted is replayed from the
cache (same requests, same answers) and written once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k2_data.agent.client import AsyncHTTPChatClient
from k2_data.agentic.generate import make_agent, make_tasks
from k2_data.agentic.judge import judge
from k2_data.agentic.ledger import Ledger, read_records, rewrite
from k2_data.agentic.repository import ToolRepository, import_mcp_servers, import_openai_json
from k2_data.agentic.servers import SHIPPED
from k2_data.agentic.trajectory import Limits, rollout


@dataclass
class AgenticConfig:
    out: Path
    base_url: str
    model: str
    api_key: str | None = None
    servers: list[str] = field(default_factory=lambda: list(SHIPPED))  # shipped names or command lines
    tool_files: list[str] = field(default_factory=list)  # OpenAI-format JSON/JSONL
    agents: int = 4
    tasks_per_agent: int = 2
    tools_per_agent: int = 3
    seed: int = 0
    concurrency: int = 8  # requests in flight (and trajectories at once)
    min_score: float = 1.0  # share of rubric criteria the judge must find met
    limits: Limits = field(default_factory=Limits)
    judge_model: str | None = None
    user_model: str | None = None
    tool_model: str | None = None
    timeout_s: float = 300.0
    gen_max_tokens: int = 1024  # per agent-profile and judge reply (twice that for a task list)

    def validate(self) -> None:
        if self.agents < 1 or self.tasks_per_agent < 1 or self.tools_per_agent < 1:
            raise ValueError("agents, tasks_per_agent and tools_per_agent must be >= 1")
        if not 0 <= self.min_score <= 1:
            raise ValueError(f"min_score must be in [0, 1], got {self.min_score}")
        if self.limits.max_turns < 1 or self.limits.max_steps < 1:
            raise ValueError("max_turns and max_steps must be >= 1")


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big")


async def build_repository(cfg: AgenticConfig, counters: Counter) -> ToolRepository:
    path = cfg.out / "tools.jsonl"
    if path.exists():
        counters["repository_resumed"] = 1
        return ToolRepository.load(path)
    repo = ToolRepository()
    if cfg.servers:
        await import_mcp_servers(repo, cfg.servers)
    for f in cfg.tool_files:
        import_openai_json(repo, f)
    if not len(repo):
        raise ValueError("no tools: give MCP servers and/or OpenAI tool files")
    repo.save(path)
    return repo


async def _arun(cfg: AgenticConfig) -> dict[str, Any]:
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counters: Counter = Counter()
    repo = await build_repository(cfg, counters)
    t_tools = time.perf_counter() - t0
    client = AsyncHTTPChatClient(
        cfg.base_url,
        cfg.api_key,
        max_concurrency=cfg.concurrency,
        cache=cfg.out / ".k2-agentic" / "cache.sqlite",
        timeout_s=cfg.timeout_s,
    )
    try:
        agents = await asyncio.gather(
            *(
                make_agent(
                    client,
                    cfg.model,
                    f"a{i:04d}",
                    [
                        e.spec
                        for e in repo.sample(cfg.tools_per_agent, random.Random(_seed(cfg.seed, "tools", i)))
                    ],
                    _seed(cfg.seed, "agent", i),
                    counters,
                    max_tokens=cfg.gen_max_tokens,
                )
                for i in range(cfg.agents)
            )
        )
        rewrite(cfg.out / "agents.jsonl", list(agents))
        task_lists = await asyncio.gather(
            *(
                make_tasks(
                    client,
                    cfg.model,
                    a,
                    cfg.tasks_per_agent,
                    _seed(cfg.seed, "tasks", a["id"]),
                    counters,
                    max_tokens=2 * cfg.gen_max_tokens,
                )
                for a in agents
            )
        )
        tasks = [t for ts in task_lists for t in ts]
        rewrite(cfg.out / "tasks.jsonl", tasks)
        by_agent = {a["id"]: a for a in agents}
        done = await _trajectories(cfg, client, by_agent, tasks, counters)
    finally:
        await client.aclose()
    elapsed = time.perf_counter() - t0
    records = done.records
    accepted = [r for r in records if r["verdict"]["accepted"]]
    new = counters["trajectories_new"]
    summary = {
        "tools": len(repo),
        "tools_by_source": repo.counts(),
        "tool_import_seconds": round(t_tools, 2),
        "agents": len(agents),
        "agents_from_llm": sum(a["origin"] == "llm" for a in agents),
        "tasks": len(tasks),
        "tasks_from_llm": sum(t["origin"] == "llm" for t in tasks),
        "trajectories": len(records),
        "trajectories_this_run": new,
        "accepted": len(accepted),
        "acceptance_rate": len(accepted) / len(records) if records else 0.0,
        "mean_turns": sum(r["turns"] for r in records) / max(len(records), 1),
        "mean_tool_calls": sum(r["tool_calls"] for r in records) / max(len(records), 1),
        "seconds": round(elapsed, 2),
        "trajectories_per_second": round(new / elapsed, 4) if elapsed else 0.0,
        "completion_tokens_per_second": round(client.stats.completion_tokens / elapsed, 1)
        if elapsed
        else 0.0,
        "client": client.stats.as_dict(),
        "counters": dict(sorted(counters.items())),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "out")},
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


async def _trajectories(
    cfg: AgenticConfig, client: Any, agents: dict[str, dict], tasks: list[dict], counters: Counter
) -> Ledger:
    ledger = Ledger(cfg.out / "trajectories.jsonl")
    done = ledger.ids()
    sft_path = cfg.out / "sft.jsonl"
    kept = {r["id"] for r in ledger.records if r["verdict"]["accepted"]}
    sft = [r for r in read_records(sft_path) if r["id"] in kept]
    sft = list({r["id"]: r for r in sft}.values())  # a kill between the two writes: keep one
    rewrite(sft_path, sft)
    sft_ledger = Ledger(sft_path)
    counters["trajectories_skipped_done"] = sum(t["id"] in done for t in tasks)
    lock = asyncio.Lock()
    gate = asyncio.Semaphore(cfg.concurrency)

    async def one(task: dict[str, Any]) -> None:
        async with gate:
            seed = _seed(cfg.seed, "trajectory", task["id"])
            agent = agents[task["agent_id"]]
            traj = await rollout(
                client,
                cfg.model,
                agent,
                task,
                seed,
                cfg.limits,
                counters,
                user_model=cfg.user_model,
                tool_model=cfg.tool_model,
            )
            verdict = await judge(
                client,
                cfg.judge_model or cfg.model,
                task,
                traj,
                seed,
                counters,
                min_score=cfg.min_score,
                max_tokens=cfg.gen_max_tokens,
            )
            async with lock:
                if verdict["accepted"] and task["id"] not in {r["id"] for r in sft_ledger.records}:
                    sft_ledger.append(
                        {"id": task["id"], "messages": traj["messages"], "tools": traj["tools"]}
                    )
                ledger.append({**traj, "task": task, "verdict": verdict})
                counters["trajectories_new"] += 1

    try:
        await asyncio.gather(*(one(t) for t in tasks if t["id"] not in done))
    finally:
        ledger.close()
        sft_ledger.close()
    return ledger


def run_agentic(cfg: AgenticConfig) -> dict[str, Any]:
    return asyncio.run(_arun(cfg))
