"""What the shipped servers share: an `MCPServer` that logs only warnings (stdout is the protocol)."""

from __future__ import annotations

from typing import Any


def make_server(name: str, instructions: str) -> Any:
    try:
        from mcp.server.mcpserver import MCPServer
    except ImportError as e:  # the `agentic` extra
        raise ImportError("the shipped MCP servers need the mcp SDK: pip install 'k2-data[agentic]'") from e
    return MCPServer(name, instructions=instructions, log_level="WARNING")


def tool_error(message: str) -> Exception:
    """A deliberate tool failure: the client gets `is_error` with exactly this message."""
    from mcp.server.mcpserver.exceptions import ToolError

    return ToolError(message)
