"""Import tools from MCP servers over stdio with the official `mcp` SDK (2.x), and call them for real.

    specs = await list_mcp_tools(server_spec("calculator"))        # spec-only Tools: name, description, schema
    async with MCPSession(server_spec("kvstore")) as session:      # one live server process
        tools = session.tools()                                    # Tools whose fn calls the server
        text = await session.call("kv_set", {"key": "a", "value": "1"})

A server is a shipped one by name (`calculator`, `kvstore`, `filesystem`: `python -m
k2_data.agentic.servers.NAME` with this interpreter) or any command line (`npx -y @scope/server ...`).
Each server process is recorded with this process's watchdog (`k2_data.lifetime`): it dies with
this process, SIGKILL included.
"""

from __future__ import annotations

import shlex
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from k2_data import lifetime
from k2_data.agent.tools import Tool, tool_from_spec
from k2_data.agentic.servers import SHIPPED, module_of


class MCPToolError(RuntimeError):
    """The server answered a tool call with `is_error`; the message is the server's text."""


@dataclass
class ServerSpec:
    """How to start one stdio MCP server; `name` labels the tools' source (`mcp:NAME`)."""

    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None


def server_spec(text: str, env: dict[str, str] | None = None) -> ServerSpec:
    """A shipped server's name, or a command line (its first word names it)."""
    if text in SHIPPED:
        return ServerSpec(text, sys.executable, ["-m", module_of(text)], env)
    argv = shlex.split(text)
    if not argv:
        raise ValueError("empty MCP server command")
    name = argv[-1].rsplit("/", 1)[-1].rsplit(".", 1)[-1] if argv[0].endswith("python") else argv[0]
    return ServerSpec(name, argv[0], argv[1:], env)


def _import_mcp() -> Any:
    try:
        import mcp
    except ImportError as e:  # the `agentic` extra
        raise ImportError("MCP import needs the mcp SDK: pip install 'k2-data[agentic]'") from e
    return mcp


def result_text(result: Any) -> str:
    """The text of a `CallToolResult`: its text blocks joined, else its structured content as JSON."""
    import json

    texts = [getattr(block, "text", None) for block in result.content or []]
    texts = [t for t in texts if t is not None]
    if texts:
        return "\n".join(texts)
    if result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return ""


class MCPSession:
    """One started stdio server: `tools()` (callable Tools) and `call(name, arguments)`."""

    def __init__(self, server: ServerSpec, read_timeout_s: float = 60.0):
        self.server, self.read_timeout_s = server, read_timeout_s
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._specs: list[dict[str, Any]] = []

    async def __aenter__(self) -> MCPSession:
        mcp = _import_mcp()
        params = mcp.StdioServerParameters(
            command=self.server.command, args=self.server.args, env=self.server.env, cwd=self.server.cwd
        )
        self._stack = AsyncExitStack()
        try:
            self._client = await self._stack.enter_async_context(
                mcp.Client(params, read_timeout_seconds=self.read_timeout_s)
            )
            lifetime.adopt()  # the SDK starts the server in a session of its own: tie it to us
            self._specs = await self._list()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def _list(self) -> list[dict[str, Any]]:
        specs: list[dict[str, Any]] = []
        cursor = None
        while True:
            page = await self._client.list_tools(cursor=cursor)
            for t in page.tools:
                specs.append(
                    {"name": t.name, "description": t.description or "", "parameters": dict(t.input_schema)}
                )
            cursor = page.next_cursor
            if not cursor:
                return specs

    def specs(self) -> list[dict[str, Any]]:
        """The listed tools as OpenAI `tools` entries."""
        return [{"type": "function", "function": dict(s)} for s in self._specs]

    async def call(self, name: str, arguments: dict[str, Any], read_timeout_s: float | None = None) -> str:
        """The tool's text result; `MCPToolError` when the server reports an error. `read_timeout_s`
        bounds this call (default: the session's)."""
        result = await self._client.call_tool(name, arguments, read_timeout_seconds=read_timeout_s)
        text = result_text(result)
        if result.is_error:
            raise MCPToolError(text or f"tool {name} failed")
        return text

    def tools(self) -> list[Tool]:
        """Tools whose `fn(**arguments)` calls the live server (valid while the session is open)."""

        def bind(name: str) -> Any:
            async def fn(**arguments: Any) -> str:
                return await self.call(name, arguments)

            fn.__name__ = name
            return fn

        return [tool_from_spec(s, fn=bind(s["name"])) for s in self._specs]

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None


async def list_mcp_tools(server: ServerSpec, read_timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Start the server, list its tools (every page) and stop it: OpenAI `tools` entries keeping each
    tool's name, description and input schema."""
    async with MCPSession(server, read_timeout_s) as session:
        return session.specs()
