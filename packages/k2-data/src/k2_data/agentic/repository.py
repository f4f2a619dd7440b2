"""The tool repository: OpenAI tool specs with where each came from, saved as JSONL.

An entry is `{"spec": {"type": "function", "function": {...}}, "source": "mcp:calculator" |
"json:FILE" | "synthetic", "category": "...", "domain": "...", "server": "..."}`: `category` is the MCP
server's name, the JSON file's stem or a synthetic tool's category; `domain` a synthetic tool's
`CATEGORY/DOMAIN` (from domain evolution); `server` how to start an MCP tool's server (a shipped name or a
command line), so the pipeline can call the tool for real, also when resuming from `tools.jsonl`. Names are unique in a repository (a later duplicate is
dropped and counted). `sample(k, rng)` draws a tool set for one agent.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2_data.agent.tools import Tool, load_openai_tools, tool_from_spec


@dataclass
class ToolEntry:
    spec: dict[str, Any]
    source: str
    category: str = ""
    domain: str = ""
    server: str = ""

    @property
    def name(self) -> str:
        return self.spec["function"]["name"]

    def tool(self) -> Tool:
        return tool_from_spec(self.spec)


@dataclass
class ToolRepository:
    entries: list[ToolEntry] = field(default_factory=list)
    duplicates: int = 0  # entries dropped because their name was already present

    def add(
        self, spec: dict[str, Any], source: str, category: str = "", domain: str = "", server: str = ""
    ) -> bool:
        t = tool_from_spec(spec)  # validates; normalises a bare function object
        if t.name in self.names():
            self.duplicates += 1
            return False
        self.entries.append(ToolEntry(t.spec(), source, category, domain, server))
        return True

    def extend(
        self,
        specs: Iterable[dict[str, Any]],
        source: str,
        category: str = "",
        domain: str = "",
        server: str = "",
    ) -> int:
        return sum(self.add(s, source, category, domain, server) for s in specs)

    def names(self) -> set[str]:
        return {e.name for e in self.entries}

    def by_name(self, name: str) -> ToolEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def __len__(self) -> int:
        return len(self.entries)

    def mcp_servers(self) -> dict[str, str]:
        """Tool name -> MCP server name (`mcp:NAME` sources) for the entries that know their server."""
        return {e.name: e.source[4:] for e in self.entries if e.source.startswith("mcp:") and e.server}

    def server_commands(self) -> dict[str, str]:
        """MCP server name -> how to start it (a shipped name or a command line)."""
        return {e.source[4:]: e.server for e in self.entries if e.source.startswith("mcp:") and e.server}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.source] = out.get(e.source, 0) + 1
        return out

    def sample(self, k: int, rng: random.Random) -> list[ToolEntry]:
        """`k` tools (fewer if the repository is smaller), preferring one source's tools together: half
        the time the set comes from a single source when it has enough tools, like a real toolkit."""
        if not self.entries:
            raise ValueError("the tool repository is empty")
        by_source: dict[str, list[ToolEntry]] = {}
        for e in self.entries:
            by_source.setdefault(e.source, []).append(e)
        pool = self.entries
        if rng.random() < 0.5:
            fits = [s for s in sorted(by_source) if len(by_source[s]) >= k]
            if fits:
                pool = by_source[rng.choice(fits)]
        return rng.sample(pool, min(k, len(pool)))

    def save(self, path: str | Path) -> None:
        p = Path(path)
        tmp = p.with_suffix(p.suffix + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for e in self.entries:
                rec = {"spec": e.spec, "source": e.source, "category": e.category}
                rec.update({k: v for k, v in (("domain", e.domain), ("server", e.server)) if v})
                f.write(json.dumps(rec) + "\n")
        tmp.replace(p)

    @classmethod
    def load(cls, path: str | Path) -> ToolRepository:
        repo = cls()
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                repo.add(
                    rec["spec"],
                    rec["source"],
                    rec.get("category", ""),
                    rec.get("domain", ""),
                    rec.get("server", ""),
                )
        return repo


def import_openai_json(repo: ToolRepository, path: str | Path) -> int:
    """Add the tools of an OpenAI-format JSON/JSONL file (source `json:NAME`); returns how many were new."""
    p = Path(path)
    return repo.extend((t.spec() for t in load_openai_tools(p)), f"json:{p.stem}", p.stem)


async def import_mcp_servers(repo: ToolRepository, servers: list[str], read_timeout_s: float = 60.0) -> int:
    """Start each MCP server (a shipped name or a command line) concurrently, list its tools and add them
    (source `mcp:NAME`, category NAME); returns how many were new."""
    from k2_data.agentic.mcp_import import list_mcp_tools, server_spec

    specs = [server_spec(s) for s in servers]
    listed = await asyncio.gather(*(list_mcp_tools(s, read_timeout_s) for s in specs))
    return sum(
        repo.extend(tools, f"mcp:{s.name}", s.name, server=text)
        for text, s, tools in zip(servers, specs, listed)
    )
