"""A filesystem MCP server confined to one directory: `python -m k2_data.agentic.servers.filesystem`.

The root is `$K2_MCP_FS_ROOT` when set, else a fresh temporary directory removed at exit; every path is
relative to it and a path that resolves outside it is refused.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from k2_data.agentic.servers._base import make_server, tool_error

server = make_server("filesystem", "Read and write text files in a sandboxed directory.")
MAX_BYTES = 1 << 20


def _root() -> Path:
    if os.environ.get("K2_MCP_FS_ROOT"):
        root = Path(os.environ["K2_MCP_FS_ROOT"])
        root.mkdir(parents=True, exist_ok=True)
        return root.resolve()
    tmp = tempfile.mkdtemp(prefix="k2-mcp-fs-")
    atexit.register(shutil.rmtree, tmp, True)
    return Path(tmp).resolve()


ROOT = _root()


def _resolve(path: str) -> Path:
    p = (ROOT / path).resolve()
    if p != ROOT and ROOT not in p.parents:
        raise tool_error(f"path {path!r} is outside the sandbox")
    return p


@server.tool()
def write_file(path: str, content: str) -> str:
    """Write text to a file (parent directories are created; an existing file is overwritten)."""
    if len(content.encode()) > MAX_BYTES:
        raise tool_error(f"content larger than {MAX_BYTES} bytes")
    p = _resolve(path)
    if p.is_dir():
        raise tool_error(f"{path} is a directory")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(content, encoding="utf-8")
    return f"wrote {len(content)} characters to {path}"


@server.tool()
def read_file(path: str) -> str:
    """The text of a file."""
    p = _resolve(path)
    if not p.is_file():
        raise tool_error(f"no such file: {path}")
    return p.read_text(encoding="utf-8", errors="replace")


@server.tool()
def list_files(path: str = ".") -> list[str]:
    """The files and directories under a directory (recursively), as relative paths, sorted."""
    p = _resolve(path)
    if not p.is_dir():
        raise tool_error(f"no such directory: {path}")
    return sorted(str(q.relative_to(ROOT)) + ("/" if q.is_dir() else "") for q in p.rglob("*"))


@server.tool()
def delete_file(path: str) -> str:
    """Delete a file."""
    p = _resolve(path)
    if not p.is_file():
        raise tool_error(f"no such file: {path}")
    p.unlink()
    return f"deleted {path}"


if __name__ == "__main__":
    server.run("stdio")
