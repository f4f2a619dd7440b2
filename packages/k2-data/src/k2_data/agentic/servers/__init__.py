"""Small MCP servers shipped with k2-data, so tool import and real tool calls run offline and in tests.

Each is a module runnable as a stdio MCP server (`python -m k2_data.agentic.servers.calculator`), built on
the official `mcp` SDK 2.x (`mcp.server.mcpserver.MCPServer`; the extra `k2-data[agentic]`):

- `calculator`: `calculate(expression)` (safe arithmetic), `statistics(numbers)`
- `kvstore`: `kv_set`, `kv_get`, `kv_delete`, `kv_list` over an in-memory dict
- `filesystem`: `write_file`, `read_file`, `list_files`, `delete_file` inside a fresh temporary directory
  (or `$K2_MCP_FS_ROOT`); paths that leave it are refused
"""

SHIPPED = ("calculator", "kvstore", "filesystem")


def module_of(name: str) -> str:
    """The `python -m` module of a shipped server."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped MCP server {name!r}; shipped: {', '.join(SHIPPED)}")
    return f"k2_data.agentic.servers.{name}"
