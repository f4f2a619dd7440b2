"""A shipped MCP server run live for the episodes of a run (the calculator and kvstore-mcp
environments): one started server, shared by every episode, tied to this process."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any


class LiveServer:
    """One started MCP server on an event loop of its own (a daemon thread); `call` is synchronous.
    Calls run one at a time in the server's task (the SDK's scopes are entered and left by one task)."""

    def __init__(self, name: str, timeout_s: float = 30.0) -> None:
        from k2_data.agentic.mcp_import import server_spec

        self.spec, self.timeout_s = server_spec(name), timeout_s
        self.loop = asyncio.new_event_loop()
        self.ready: Future = Future()
        self.queue: asyncio.Queue | None = None
        self.thread = threading.Thread(target=self._run, name=f"mcp-{name}", daemon=True)
        self.thread.start()
        self.specs: list[dict] = self.ready.result(timeout=timeout_s)

    def _run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        from k2_data.agentic.mcp_import import MCPSession

        self.queue = asyncio.Queue()
        try:
            session = await MCPSession(self.spec, read_timeout_s=self.timeout_s).__aenter__()
        except Exception as e:
            self.ready.set_exception(e)
            return
        self.ready.set_result(session.specs())
        try:
            while (item := await self.queue.get()) is not None:
                fut, name, args = item
                try:
                    fut.set_result(await session.call(name, args))
                except Exception as e:
                    fut.set_exception(e)
        finally:
            await session.__aexit__(None, None, None)

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        fut: Future = Future()
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (fut, name, arguments))
        return fut.result(timeout=self.timeout_s)

    def close(self) -> None:
        if self.thread.is_alive() and self.queue is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
            self.thread.join(timeout=10)


class SharedServerMaker:
    """An `EnvMaker` base whose episodes share one `LiveServer` (`server_name`, a shipped server),
    started on the first episode and stopped by `close()`. Subclasses make the episodes and tasks."""

    name = ""
    server_name = ""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.server: LiveServer | None = None

    def live(self) -> LiveServer:
        if self.server is None:  # started on the first episode, shared by the rest
            self.server = LiveServer(self.server_name, self.timeout_s)
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
