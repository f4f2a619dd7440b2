"""`k2 data agentic`: tool repository -> agents -> tasks with rubrics -> trajectories -> judge -> SFT data.

    summary = run_agentic(AgenticConfig(out=Path("out"), base_url="http://127.0.0.1:8000/v1", model="k2"))

OUT gets `tools.jsonl` (the repository), `agents.jsonl`, `tasks.jsonl`, `trajectories.jsonl` (every
trajectory with its judge verdict), `sft.jsonl` (the kept ones as `{"id", "messages", "tools"}`, which
`k2 data sft` tokenizes with loss masks) and `summary.json`; with `heldout=N`, `heldout_tasks.jsonl`
(N tasks over the repository's CRUD tools, ground truth from the tool simulator's world model) and
`heldout_scores.json` (the endpoint's BFCL-style call accuracy and tau-style final-state accuracy on
them); `eval_only=True` scores an endpoint on those tasks and generates nothing else (a student
before and after `k2 sft`). Every LLM call goes through one
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
from k2_data.agentic.evaluate import evaluate, make_heldout_tasks
from k2_data.agentic.generate import make_agent, make_tasks
from k2_data.agentic.judge import judge
from k2_data.agentic.ledger import Ledger, read_records, rewrite
from k2_data.agentic.repository import ToolRepository, import_mcp_servers, import_openai_json
from k2_data.agentic.servers import SHIPPED
from k2_data.agentic.state import classify
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
    evolve_tools: int = 0  # synthetic tools to grow by domain evolution (0: none)
    evolve_categories: int = 4
    evolve_domains: int = 2  # application domains per category
    evolve_refill_rounds: int = 2  # extra tool requests per domain while fewer than evolve_tools survive
    dedup_threshold: float = 0.85  # embedding cosine at which a synthetic tool is a near-duplicate
    coverage: bool = True  # write OUT/tool_coverage.png (needs scikit-learn, matplotlib, the embedder)
    execute_mcp: bool = True  # call MCP tools on their live servers (False: simulate them like the rest)
    mcp_timeout_s: float = 30.0  # per real MCP tool call
    gen_max_tokens: int = 1024  # per agent-profile and judge reply (twice that for a task list)
    code_tool: bool = False  # put `run_python` in the repository; its calls run in k2_data.sandbox
    code_timeout_s: float = 10.0  # per sandboxed program (wall clock and CPU)
    code_memory_mb: int = 256
    heldout: int = 0  # held-out CRUD tasks the endpoint is scored on after the run (0: none)
    eval_only: bool = False  # only score the endpoint on the held-out tasks (built once, then read back)
    scores_file: Path | None = None  # where the held-out scores go (default OUT/heldout_scores.json)

    def validate(self) -> None:
        if self.agents < 1 or self.tasks_per_agent < 1 or self.tools_per_agent < 1:
            raise ValueError("agents, tasks_per_agent and tools_per_agent must be >= 1")
        if not 0 <= self.min_score <= 1:
            raise ValueError(f"min_score must be in [0, 1], got {self.min_score}")
        if self.limits.max_turns < 1 or self.limits.max_steps < 1:
            raise ValueError("max_turns and max_steps must be >= 1")
        if self.evolve_tools < 0 or self.evolve_categories < 1 or self.evolve_domains < 1:
            raise ValueError("evolve_tools must be >= 0, evolve_categories and evolve_domains >= 1")
        if self.evolve_refill_rounds < 0:
            raise ValueError(f"evolve_refill_rounds must be >= 0, got {self.evolve_refill_rounds}")
        if not 0 < self.dedup_threshold <= 1:
            raise ValueError(f"dedup_threshold must be in (0, 1], got {self.dedup_threshold}")
        if self.heldout < 0:
            raise ValueError(f"heldout must be >= 0, got {self.heldout}")
        if self.eval_only and not self.heldout:
            raise ValueError("eval_only scores the endpoint on held-out tasks: give heldout=N (--heldout N)")


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big")


async def build_repository(
    cfg: AgenticConfig, counters: Counter, client: Any = None
) -> tuple[ToolRepository, dict[str, Any] | None]:
    """The repository and the evolution report (None without `evolve_tools`); read back on resume."""
    path, report_path = cfg.out / "tools.jsonl", cfg.out / "evolution.json"
    if path.exists():
        counters["repository_resumed"] = 1
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        return ToolRepository.load(path), report
    repo = ToolRepository()
    if cfg.servers:
        await import_mcp_servers(repo, cfg.servers)
    for f in cfg.tool_files:
        import_openai_json(repo, f)
    if cfg.code_tool:
        from k2_data.agentic.code_tool import CODE_CATEGORY, CODE_DOMAIN, CODE_SOURCE, CODE_TOOL_SPEC

        repo.add(CODE_TOOL_SPEC, CODE_SOURCE, CODE_CATEGORY, CODE_DOMAIN)
    report = None
    if cfg.evolve_tools > 0:
        from k2_data.agentic.evolve import EvolveConfig, evolve_tools

        t0 = time.perf_counter()
        entries, rep = await evolve_tools(
            client,
            cfg.model,
            EvolveConfig(
                n_tools=cfg.evolve_tools,
                categories=cfg.evolve_categories,
                domains_per_category=cfg.evolve_domains,
                dedup_threshold=cfg.dedup_threshold,
                refill_rounds=cfg.evolve_refill_rounds,
                seed=cfg.seed,
                max_tokens=2 * cfg.gen_max_tokens,
                concurrency=cfg.concurrency,
            ),
            existing=repo.entries,
            counters=counters,
        )
        for e in entries:
            repo.add(e["spec"], "synthetic", e["category"], e["domain"])
        report = {**rep.as_dict(), "seconds": round(time.perf_counter() - t0, 2)}
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    if not len(repo):
        raise ValueError("no tools: give MCP servers, OpenAI tool files and/or --evolve-tools")
    repo.save(path)
    return repo, report


async def _arun(cfg: AgenticConfig) -> dict[str, Any]:
    cfg.validate()
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    counters: Counter = Counter()
    client = AsyncHTTPChatClient(
        cfg.base_url,
        cfg.api_key,
        max_concurrency=cfg.concurrency,
        cache=cfg.out / ".k2-agentic" / "cache.sqlite",
        timeout_s=cfg.timeout_s,
    )
    try:
        repo, evolution = await build_repository(cfg, counters, client)
        t_tools = time.perf_counter() - t0
        if cfg.eval_only:
            heldout = await score_heldout(cfg, repo)
            return {"tools": len(repo), "tools_by_source": repo.counts(), "heldout": heldout}
        coverage = _coverage(cfg, repo, counters)
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
        done = await _trajectories(cfg, client, by_agent, tasks, counters, repo)
        heldout = await score_heldout(cfg, repo) if cfg.heldout else None
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
        "evolution": evolution,
        "coverage": coverage,
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
        "real_mcp_calls": sum(len(r.get("mcp_calls") or []) for r in records),
        "sandboxed_code_calls": sum(len(r.get("code_calls") or []) for r in records),
        "seconds": round(elapsed, 2),
        "trajectories_per_second": round(new / elapsed, 4) if elapsed else 0.0,
        "completion_tokens_per_second": round(client.stats.completion_tokens / elapsed, 1)
        if elapsed
        else 0.0,
        "client": client.stats.as_dict(),
        "heldout": heldout,
        "counters": dict(sorted(counters.items())),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "out")},
    }
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


async def _trajectories(
    cfg: AgenticConfig,
    client: Any,
    agents: dict[str, dict],
    tasks: list[dict],
    counters: Counter,
    repo: ToolRepository,
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
    servers_of: dict[str, str] = {}
    mcp_servers: dict[str, Any] = {}
    if cfg.execute_mcp:
        from k2_data.agentic.mcp_import import ServerSpec, server_spec

        for name, command in repo.server_commands().items():
            spec = server_spec(command)
            mcp_servers[name] = ServerSpec(name, spec.command, spec.args, spec.env, spec.cwd)
        servers_of = repo.mcp_servers()

    async def one(task: dict[str, Any]) -> None:
        async with gate:
            seed = _seed(cfg.seed, "trajectory", task["id"])
            agent = agents[task["agent_id"]]
            code = None
            if cfg.code_tool:
                from k2_data.agentic.code_tool import CodeExecutor

                code = CodeExecutor(
                    timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb, counters=counters
                )
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
                mcp_servers=mcp_servers,
                servers_of={
                    t["function"]["name"]: servers_of[t["function"]["name"]]
                    for t in agent["tools"]
                    if t["function"]["name"] in servers_of
                },
                mcp_timeout_s=cfg.mcp_timeout_s,
                code=code,
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


def _coverage(cfg: AgenticConfig, repo: ToolRepository, counters: Counter) -> dict[str, Any] | None:
    """OUT/tool_coverage.png and its numbers (OUT/coverage.json); a resumed run whose repository came back
    from tools.jsonl unchanged reuses them (loading the embedder and scikit-learn costs seconds)."""
    if not cfg.coverage:
        return None
    png, stats = cfg.out / "tool_coverage.png", cfg.out / "coverage.json"
    if counters.get("repository_resumed") and png.exists() and stats.exists():
        return json.loads(stats.read_text())
    try:
        from k2_data.agentic.coverage import plot_coverage

        cov = plot_coverage(repo, png)
    except ImportError as e:  # scikit-learn, matplotlib or the embedding model missing
        counters["coverage_skipped"] += 1
        return {"skipped": str(e)}
    out = {k: v for k, v in cov.items() if k not in ("points", "labels")}
    stats.write_text(json.dumps(out, indent=2) + "\n")
    return out


HELDOUT_SYSTEM_PROMPT = "You are a helpful assistant. Use the tools to do exactly what the user asks."


def heldout_tasks(cfg: AgenticConfig, repo: ToolRepository) -> list[dict[str, Any]]:
    """`cfg.heldout` tasks over the repository's CRUD tools, built once into OUT/heldout_tasks.jsonl
    and read back afterwards, so a student is scored before and after SFT on the same tasks."""
    path = cfg.out / "heldout_tasks.jsonl"
    if path.exists():
        return read_records(path)
    tasks = make_heldout_tasks([e.spec for e in repo.entries], cfg.heldout, seed=_seed(cfg.seed, "heldout"))
    if not tasks:
        raise ValueError(
            f"--heldout {cfg.heldout}: none of the {len(repo)} tools is a CRUD tool with a create "
            "operation (names like create_note / add_item / set_key) to build held-out tasks from"
        )
    rewrite(path, tasks)
    return tasks


async def score_heldout(cfg: AgenticConfig, repo: ToolRepository) -> dict[str, Any]:
    """The endpoint (`cfg.base_url`, `cfg.model`) on the held-out tasks: one user turn each, the stateful
    simulator answering every call (no edge failures), BFCL-style call checks and the final state
    against the world model's. Written to `cfg.scores_file` (default OUT/heldout_scores.json) with
    every task's score; returns the summary. No request cache: the same model name served before and
    after training must not get the earlier answers back."""
    from dataclasses import replace

    tasks = heldout_tasks(cfg, repo)
    collections = {classify(c["name"])[1] for t in tasks for c in t["rubric"]["expected_calls"]}
    tools = [
        e.spec for e in repo.entries if (k := classify(e.spec["function"]["name"])) and k[1] in collections
    ]
    agent = {"id": "heldout", "system_prompt": HELDOUT_SYSTEM_PROMPT, "tools": tools, "origin": "template"}
    t0 = time.perf_counter()
    async with AsyncHTTPChatClient(
        cfg.base_url, cfg.api_key, max_concurrency=cfg.concurrency, timeout_s=cfg.timeout_s
    ) as client:
        result = await evaluate(
            client,
            cfg.model,
            agent,
            tasks,
            limits=replace(cfg.limits, max_turns=1),
            seed=cfg.seed,
            concurrency=cfg.concurrency,
        )
    summary = {
        "model": cfg.model,
        "base_url": cfg.base_url,
        **result["summary"],
        "seconds": round(time.perf_counter() - t0, 2),
    }
    path = cfg.scores_file or cfg.out / "heldout_scores.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"summary": summary, "scores": result["scores"]}, indent=2) + "\n")
    tmp.replace(path)
    return summary


def run_agentic(cfg: AgenticConfig) -> dict[str, Any]:
    from k2_data import lifetime

    lifetime.tether()  # the watchdog runs before the first MCP server or sandbox: they die with us
    return asyncio.run(_arun(cfg))
