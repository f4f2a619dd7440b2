"""The tool repository: OpenAI-format JSON import, and MCP import over stdio from a shipped server."""

from __future__ import annotations

import asyncio
import json

import pytest
from k2_data.agent.tools import UnboundToolError, load_openai_tools, tool_from_spec
from k2_data.agentic.repository import ToolRepository, import_mcp_servers, import_openai_json
from k2_data.examples.tooluse import TOOLS


def test_tool_from_spec_round_trips_openai_entries_and_bare_functions():
    for spec in TOOLS:
        assert tool_from_spec(spec).spec() == spec
        assert tool_from_spec(spec["function"]).spec() == spec
    t = tool_from_spec(TOOLS[0])
    with pytest.raises(UnboundToolError, match="calculator"):
        t.fn(expression="1+1")


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"type": "function", "function": {"name": "has space"}}, "name"),
        ({"name": "x", "parameters": {"type": "array"}}, "parameters"),
        ({"type": "retrieval", "function": {"name": "x"}}, "type"),
    ],
)
def test_tool_from_spec_names_the_bad_field(bad, field):
    with pytest.raises(ValueError, match=field):
        tool_from_spec(bad)


def test_openai_json_and_jsonl_import(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"tools": TOOLS}))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(t) for t in TOOLS[:2]) + "\n")
    assert [t.name for t in load_openai_tools(tmp_path / "a.json")] == [t["function"]["name"] for t in TOOLS]
    repo = ToolRepository()
    assert import_openai_json(repo, tmp_path / "a.json") == 4
    assert import_openai_json(repo, tmp_path / "b.jsonl") == 0  # same names: dropped, counted
    assert repo.duplicates == 2 and repo.counts() == {"json:a": 4}
    repo.save(tmp_path / "tools.jsonl")
    again = ToolRepository.load(tmp_path / "tools.jsonl")
    assert [e.spec for e in again.entries] == [e.spec for e in repo.entries]
    (tmp_path / "bad.json").write_text(json.dumps([TOOLS[0], {"name": "no spaces allowed"}]))
    with pytest.raises(ValueError, match=r"bad.json: tools\[1\]"):
        load_openai_tools(tmp_path / "bad.json")


def test_mcp_import_launches_a_shipped_server_over_stdio_and_calls_its_tools():
    pytest.importorskip("mcp")
    from k2_data.agentic.mcp_import import MCPSession, MCPToolError, server_spec

    async def go():
        repo = ToolRepository()
        added = await import_mcp_servers(repo, ["kvstore"])
        async with MCPSession(server_spec("kvstore")) as session:
            tools = {t.name: t for t in session.tools()}
            created = await tools["kv_set"].fn(key="city", value="Paris")
            read = await session.call("kv_get", {"key": "city"})
            deleted = await session.call("kv_delete", {"key": "city"})
            with pytest.raises(MCPToolError, match="no such key: city"):
                await session.call("kv_get", {"key": "city"})
        return repo, added, created, read, deleted

    repo, added, created, read, deleted = asyncio.run(go())
    assert added == 4 and repo.counts() == {"mcp:kvstore": 4}
    kv_set = repo.by_name("kv_set").spec["function"]
    assert kv_set["description"].startswith("Store a value under a key")
    assert kv_set["parameters"]["required"] == ["key", "value"]
    assert kv_set["parameters"]["properties"]["value"]["type"] == "string"
    assert (created, read, deleted) == ("created city", "Paris", "deleted city")


def test_shipped_calculator_and_filesystem_logic():
    pytest.importorskip("mcp")
    from k2_data.agentic.servers.calculator import evaluate

    assert evaluate("(3 + 4) * 2") == 14 and evaluate("sqrt(16) / 2") == 2.0
    with pytest.raises(ValueError):
        evaluate("__import__('os')")
