"""Real execution of MCP tools inside trajectories.

A trajectory's tool that came from an MCP server (repository source `mcp:NAME`, the entry's `server`
says how to start it) is called on a live server through `MCPSession`, not the simulator:

    async with MCPExecutor({"kvstore": server_spec("kvstore")}, timeout_s=30) as ex:
        tools = ex.tools(specs, servers_of)      # Tools for the names in servers_of; call the real server

- one server process per trajectory and server, started lazily on the trajectory's first call to one of
  its tools (a trajectory that never calls it pays nothing) and stopped when the trajectory ends: state
  never leaks between trajectories (the kvstore is empty, the filesystem root a fresh temp dir), so a
  trajectory replayed on resume sees the same replies as the first time;
- the calls of one trajectory to one server run one at a time in call order (parallel calls of one turn
  are serialised FIFO), so a stateful server sees a deterministic order;
- failures are tool errors the agent sees (`MCPExecError`, sent back as `Error: ...` by the agent loop):
  the server's `is_error` text, a call past `timeout_s`, a server that does not start or dies. A server
  that failed to start is not retried within the trajectory.

Real calls are not LLM requests: they never touch the request cache. On resume a finished trajectory is
not rerun (no call repeats); an interrupted one is replayed from the start, its LLM requests answered from
the cache and its real tool calls executed again on fresh servers. For deterministic servers (the shipped
ones) the replay is identical, so every later request is a cache hit; for a server whose answers change
(clock, network), the replay diverges at that call and the later requests are new (paid again, written
once). Side effects of an external server outside its process are repeated by such a replay.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from k2_data.agent.tools import Tool, tool_from_spec
from k2_data.agentic.mcp_import import MCPSession, MCPToolError, ServerSpec


class MCPExecError(RuntimeError):
    """A real MCP call failed; the message is what the agent sees."""


class _Worker:
    """One live server owned by one task (the SDK's cancel scopes must be entered and left by the same
    task, and the agent runs a turn's calls in tasks of their own): calls go through a FIFO queue, so a
    trajectory's calls to the server run one at a time in call order."""

    def __init__(self, spec: ServerSpec, timeout_s: float, start_timeout_s: float):
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        try:
            async with asyncio.timeout(self.start_timeout_s):
                session = await MCPSession(self.spec, read_timeout_s=self.timeout_s).__aenter__()
        except BaseException as e:  # includes the start timeout
            if not self.ready.done():
                self.ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if not isinstance(e, Exception):
                raise
            return
        self.ready.set_result(None)
        try:
            while (item := await self.queue.get()) is not None:
                fut, name, arguments = item
                try:
                    result = await session.call(name, arguments, read_timeout_s=self.timeout_s)
                except Exception as e:
                    if not fut.done():
                        fut.set_exception(e)
                else:
                    if not fut.done():
                        fut.set_result(result)
        finally:
            await session.__aexit__(None, None, None)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((fut, name, arguments))
        # the worker bounds the call too (the SDK's read timeout), so a hung call frees the queue
        return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s + 1.0)

    async def close(self) -> None:
        if not self.task.done():
            self.queue.put_nowait(None)
        try:
            await self.task
        except Exception:
            pass


class MCPExecutor:
    def __init__(
        self,
        servers: dict[str, ServerSpec],
        *,
        timeout_s: float = 30.0,
        start_timeout_s: float = 60.0,
        counters: Counter | None = None,
    ):
        self.servers = servers
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.counters = counters if counters is not None else Counter()
        self._workers: dict[str, _Worker] = {}
        self._failed: dict[str, str] = {}
        self.calls: list[dict[str, Any]] = []  # {"server", "tool", "arguments", "ok", "result"} in order

    def tools(self, specs: list[dict[str, Any]], servers_of: dict[str, str]) -> list[Tool]:
        """Tools for the specs whose name maps to a server in `servers_of` (tool name -> server name)."""
        out = []
        for spec in specs:
            t = tool_from_spec(spec)
            server = servers_of.get(t.name)
            if server is None:
                continue
            if server not in self.servers:
                raise ValueError(f"tool {t.name}: MCP server {server!r} is not known to the executor")

            def bind(server: str, name: str) -> Any:
                async def fn(**arguments: Any) -> str:
                    return await self.call(server, name, arguments)

                fn.__name__ = name
                return fn

            out.append(tool_from_spec(spec, fn=bind(server, t.name)))
        return out

    async def _worker(self, server: str) -> _Worker:
        if server in self._failed:
            raise MCPExecError(self._failed[server])
        if server not in self._workers:
            self._workers[server] = _Worker(self.servers[server], self.timeout_s, self.start_timeout_s)
            self.counters["mcp_sessions"] += 1
        w = self._workers[server]
        try:
            await asyncio.shield(w.ready)
        except Exception as e:
            if server not in self._failed:
                self.counters["mcp_start_failures"] += 1
                why = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
                self._failed[server] = f"MCP server {server} unavailable ({why})"
            raise MCPExecError(self._failed[server]) from None
        return w

    async def call(self, server: str, name: str, arguments: dict[str, Any]) -> str:
        self.counters["mcp_calls"] += 1
        record: dict[str, Any] = {"server": server, "tool": name, "arguments": arguments}
        self.calls.append(record)
        try:
            worker = await self._worker(server)
            text = await worker.call(name, arguments)
        except MCPExecError as e:
            record.update(ok=False, result=str(e))
            raise
        except MCPToolError as e:
            self.counters["mcp_tool_errors"] += 1
            record.update(ok=False, result=str(e))
            raise MCPExecError(str(e)) from None
        except TimeoutError:
            self.counters["mcp_timeouts"] += 1
            msg = f"{name} timed out after {self.timeout_s:g} s"
            record.update(ok=False, result=msg)
            raise MCPExecError(msg) from None
        except Exception as e:  # the server died, a protocol error, an McpError reply (e.g. its timeout)
            timed_out = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
            self.counters["mcp_timeouts" if timed_out else "mcp_call_failures"] += 1
            msg = (
                f"{name} timed out after {self.timeout_s:g} s"
                if timed_out
                else f"{name} failed: {type(e).__name__}: {e}"
            )
            record.update(ok=False, result=msg)
            raise MCPExecError(msg) from None
        record.update(ok=True, result=text)
        return text

    async def aclose(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            await w.close()

    async def __aenter__(self) -> MCPExecutor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
