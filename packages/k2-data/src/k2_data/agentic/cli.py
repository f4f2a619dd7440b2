"""Command line of the agentic pipeline: `k2 data agentic ...` and `python -m k2_data.agentic ...`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k2_data.agentic.servers import SHIPPED

DESCRIPTION = (
    "Synthesize multi-turn tool-use SFT data: import tools from MCP servers (stdio; the shipped calculator, "
    "kvstore and filesystem servers by default) and OpenAI-format JSON files, generate agents (system prompt "
    "+ sampled tool set) and tasks with rubrics, roll out trajectories between a user simulator, the agent "
    "(any OpenAI-compatible endpoint, e.g. k2 serve) and a stateful tool simulator, and keep those a judge "
    "finds meet their rubric. OUT/sft.jsonl is ready for `k2 data sft`. Resumable and cached: rerun the same "
    "command after a kill and finished trajectories are kept, interrupted ones replayed from the cache."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="model name sent with each request")
    p.add_argument("--api-key", help="bearer token (default: none)")
    p.add_argument(
        "--mcp-server",
        action="append",
        default=None,
        metavar="NAME_OR_COMMAND",
        help=f"an MCP server to import tools from: a shipped one ({', '.join(SHIPPED)}) or a command line; "
        "repeatable (default: all shipped)",
    )
    p.add_argument("--no-mcp", action="store_true", help="import no MCP server (use --tools-json only)")
    p.add_argument(
        "--tools-json",
        action="append",
        default=[],
        metavar="FILE",
        help="OpenAI-format tools (JSON list or JSONL); repeatable",
    )
    p.add_argument(
        "--evolve-tools",
        type=int,
        default=0,
        metavar="N",
        help="grow N synthetic tools by hierarchical domain evolution (categories -> domains -> tools) "
        "through the LLM; they join the repository with source 'synthetic' (default: 0, none)",
    )
    p.add_argument("--evolve-categories", type=int, default=4, help="categories of the evolution tree")
    p.add_argument("--evolve-domains", type=int, default=2, help="application domains per category")
    p.add_argument(
        "--evolve-refill-rounds",
        type=int,
        default=2,
        help="while fewer than --evolve-tools survive the schema and duplicate filters, ask every domain "
        "again for its share of the shortfall, up to this many extra rounds (0: one round only)",
    )
    p.add_argument(
        "--dedup-threshold",
        type=float,
        default=0.85,
        help="MiniLM cosine similarity at or above which a synthetic tool is a near-duplicate (dropped)",
    )
    p.add_argument(
        "--no-coverage",
        action="store_true",
        help="do not write OUT/tool_coverage.png (PCA of tool embeddings)",
    )
    p.add_argument(
        "--simulate-mcp",
        action="store_true",
        help="simulate MCP tools like the others (default: call them on a live server per trajectory)",
    )
    p.add_argument("--mcp-timeout-s", type=float, default=30.0, help="per real MCP tool call")
    p.add_argument(
        "--code-tool",
        action="store_true",
        help="add run_python to the repository; its calls run for real in k2_data.sandbox (no network, "
        "own uid and temp dir, time and memory limits), never in the tool simulator",
    )
    p.add_argument("--code-timeout-s", type=float, default=10.0, help="per sandboxed program")
    p.add_argument("--code-memory-mb", type=int, default=256, help="per sandboxed program")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--tasks-per-agent", type=int, default=2)
    p.add_argument("--tools-per-agent", type=int, default=3)
    p.add_argument("--max-turns", type=int, default=4, help="user turns per trajectory")
    p.add_argument("--max-steps", type=int, default=6, help="agent calls per user turn")
    p.add_argument("--max-tokens", type=int, default=512, help="per agent reply")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="conversation size bound")
    p.add_argument("--edge-rate", type=float, default=0.05, help="share of tool calls failing transiently")
    p.add_argument(
        "--gen-max-tokens",
        type=int,
        default=1024,
        help="per agent-profile and judge reply (task lists: twice)",
    )
    p.add_argument("--sim-max-tokens", type=int, default=512, help="per user- and tool-simulator reply")
    p.add_argument(
        "--min-score", type=float, default=1.0, help="share of rubric criteria the judge needs met"
    )
    p.add_argument("--judge-model", help="judge model (default: --model)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument(
        "--heldout",
        type=int,
        default=0,
        metavar="N",
        help="after the run, score the endpoint on N held-out tasks over the CRUD tools (BFCL-style call "
        "checks, tau-style final state); tasks in OUT/heldout_tasks.jsonl, scores in OUT/heldout_scores.json",
    )
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="only score the endpoint on the held-out tasks (e.g. a `k2 serve` student before/after `k2 sft`)",
    )
    p.add_argument("--scores-file", type=Path, help="held-out scores file (default OUT/heldout_scores.json)")


def run(args: argparse.Namespace) -> int:
    from k2_data.agent.client import EndpointError
    from k2_data.agentic.pipeline import AgenticConfig, run_agentic
    from k2_data.agentic.trajectory import Limits

    servers = [] if args.no_mcp else (args.mcp_server or list(SHIPPED))
    cfg = AgenticConfig(
        out=args.out,
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        servers=servers,
        tool_files=args.tools_json,
        agents=args.agents,
        tasks_per_agent=args.tasks_per_agent,
        tools_per_agent=args.tools_per_agent,
        seed=args.seed,
        concurrency=args.concurrency,
        min_score=args.min_score,
        judge_model=args.judge_model,
        timeout_s=args.timeout_s,
        execute_mcp=not args.simulate_mcp,
        evolve_tools=args.evolve_tools,
        evolve_categories=args.evolve_categories,
        evolve_domains=args.evolve_domains,
        evolve_refill_rounds=args.evolve_refill_rounds,
        dedup_threshold=args.dedup_threshold,
        coverage=not args.no_coverage,
        mcp_timeout_s=args.mcp_timeout_s,
        code_tool=args.code_tool,
        code_timeout_s=args.code_timeout_s,
        code_memory_mb=args.code_memory_mb,
        gen_max_tokens=args.gen_max_tokens,
        heldout=args.heldout,
        eval_only=args.eval_only,
        scores_file=args.scores_file,
        limits=Limits(
            max_turns=args.max_turns,
            max_steps=args.max_steps,
            max_tokens=args.max_tokens,
            max_total_tokens=args.max_total_tokens,
            edge_rate=args.edge_rate,
            sim_max_tokens=args.sim_max_tokens,
        ),
    )
    try:
        summary = run_agentic(cfg)
    except (ValueError, ImportError, EndpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    held = summary.get("heldout")
    held_line = (
        f"held-out ({held['tasks']} tasks, {held['model']}): BFCL calls {held['bfcl_accuracy']:.1%}, "
        f"call recall {held['call_recall']:.1%}, tool names {held['tool_name_recall']:.1%}, "
        f"final state {held['state_accuracy']:.1%}"
        if held
        else None
    )
    if args.eval_only:
        print(held_line)
        print(f"wrote {args.scores_file or args.out / 'heldout_scores.json'}")
        return 0
    print(
        f"{summary['tools']} tools ({', '.join(f'{k} {v}' for k, v in summary['tools_by_source'].items())}), "
        f"{summary['agents']} agents, {summary['tasks']} tasks, {summary['trajectories']} trajectories "
        f"({summary['trajectories_this_run']} this run), {summary['accepted']} accepted "
        f"({summary['acceptance_rate']:.0%}), {summary['seconds']} s"
    )
    if summary.get("evolution"):
        ev = summary["evolution"]
        print(
            f"evolved {ev['kept']} synthetic tools over {len(ev['categories'])} categories / "
            f"{len(ev['domains'])} domains ({ev['proposed']} proposed, {ev['invalid_schema']} invalid schemas, "
            f"{ev['invalid_spec']} invalid specs, {ev['name_duplicates']} name clashes, "
            f"{ev['near_duplicates']} near-duplicates removed; {ev.get('rounds', 1)} rounds of tool requests)"
        )
    if summary.get("coverage") and "path" in summary["coverage"]:
        print(f"coverage picture: {summary['coverage']['path']}")
    if held_line:
        print(held_line)
    print(json.dumps(summary["counters"]))
    client = summary.get("client") or {}
    if client.get("failures"):
        print(
            f"{client['failures']} of {client['calls']} requests failed (first: {client.get('first_error')})"
        )
    if summary["accepted"] == 0:
        why = (
            f"the server refused requests: {client.get('first_error')}"
            if client.get("failures")
            else f"the judge accepted none of {summary['trajectories']} trajectories (see {args.out / 'trajectories.jsonl'})"
        )
        print(
            f"error: no trajectory was accepted, so {args.out / 'sft.jsonl'} is empty; {why}", file=sys.stderr
        )
        return 1
    print(f"wrote {args.out} (sft.jsonl: `k2 data sft {args.out / 'sft.jsonl'} --out DIR`)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2_data.agentic", description=DESCRIPTION)
    add_arguments(p)
    return run(p.parse_args(argv))
