"""A key-value store MCP server: `python -m k2_data.agentic.servers.kvstore` (stdio, in memory)."""

from __future__ import annotations

from k2_data.agentic.servers._base import make_server, tool_error

server = make_server("kvstore", "A key-value store: set, get, delete and list string keys.")
_store: dict[str, str] = {}


@server.tool()
def kv_set(key: str, value: str) -> str:
    """Store a value under a key (overwrites an existing one)."""
    if not key:
        raise tool_error("key must not be empty")
    existed = key in _store
    _store[key] = value
    return f"{'updated' if existed else 'created'} {key}"


@server.tool()
def kv_get(key: str) -> str:
    """The value stored under a key; an error if there is none."""
    if key not in _store:
        raise tool_error(f"no such key: {key}")
    return _store[key]


@server.tool()
def kv_delete(key: str) -> str:
    """Delete a key; an error if there is none."""
    if _store.pop(key, None) is None:
        raise tool_error(f"no such key: {key}")
    return f"deleted {key}"


@server.tool()
def kv_list(prefix: str = "") -> list[str]:
    """The stored keys that start with a prefix, sorted."""
    return sorted(k for k in _store if k.startswith(prefix))


if __name__ == "__main__":
    server.run("stdio")
