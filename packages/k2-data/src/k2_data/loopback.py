"""A deterministic OpenAI-protocol chat endpoint on loopback, for tests, benchmarks and offline dry runs.

`LoopbackServer(respond)` serves `POST /v1/chat/completions` from a background thread with its own
asyncio loop; `respond(request) -> Reply` scripts each answer (content, status, latency, a hang), so a
pipeline's retries, cache hits and fidelity rejections can be asserted against what went over the wire
(`server.requests`). Plain asyncio streams, no web framework: k2-data stays free of server dependencies
and one thread holds thousands of slow requests at once (the client benchmark needs 32+ in flight).

    python -m k2_data.loopback --latency-ms 200   # prints its base URL, echoes the last user turn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    """One scripted answer: `content` (a 200 chat.completion) or a raw `status` + `body`, after `delay_s`;
    `hang=True` never answers (the client's timeout must fire)."""

    content: str | None = None
    status: int = 200
    body: dict[str, Any] | None = None
    delay_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False


def completion(content: str, prompt_tokens: int = 0, completion_tokens: int | None = None) -> dict[str, Any]:
    """A chat.completion body; token counts default to whitespace words (good enough for accounting)."""
    n_out = len(content.split()) if completion_tokens is None else completion_tokens
    return {
        "id": "chatcmpl-loopback",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "loopback",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_out,
            "total_tokens": prompt_tokens + n_out,
        },
    }


def echo(request: dict[str, Any]) -> Reply:
    """Answer with the last user message's text."""
    user = [m for m in request.get("messages", []) if m.get("role") == "user"]
    return Reply(content=str(user[-1].get("content", "")) if user else "")


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
}


class LoopbackServer:
    """`POST {base_url}/chat/completions` answered by `respond(request) -> Reply` on 127.0.0.1.

    `requests` logs every request body in arrival order; `in_flight`/`max_in_flight` count requests
    being answered. Use as a context manager or call `close()`."""

    def __init__(
        self, respond: Callable[[dict[str, Any]], Reply] = echo, port: int = 0, latency_s: float = 0.0
    ):
        self.respond, self.latency_s = respond, latency_s
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(port,), daemon=True, name="loopback-openai")
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"loopback server failed to start on port {port}: {self._error}")
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    _error: BaseException | None = None

    def _run(self, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", port, backlog=1024)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:  # reported by __init__
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, payload, extra = await self._answer(method, path, body)
                data = json.dumps(payload).encode()
                out = [
                    f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}",
                    "Content-Type: application/json",
                ]
                out += [f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in extra.items())]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass  # the client closed the connection (or sent something that is not HTTP)
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, dict, dict[str, str]]:
        if method != "POST" or path.rstrip("/") != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {method} {path}"}}, {}
        try:
            request = json.loads(body)
        except json.JSONDecodeError as e:
            return 400, {"error": {"message": f"body is not JSON: {e}"}}, {}
        with self._lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self.respond(request)
            delay = self.latency_s + reply.delay_s
            if reply.hang:
                delay = 3600.0
            if delay > 0:
                await asyncio.sleep(delay)
            if reply.content is not None and reply.status == 200:
                return 200, completion(reply.content), reply.headers
            return reply.status, reply.body or {}, reply.headers
        except Exception as e:  # a broken script is a 500 the test will see
            return 500, {"error": {"message": f"responder failed: {type(e).__name__}: {e}"}}, {}
        finally:
            with self._lock:
                self.in_flight -= 1

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> LoopbackServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="An echoing OpenAI-protocol endpoint with a fixed latency.")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added to every answer")
    args = parser.parse_args(argv)
    server = LoopbackServer(echo, port=args.port, latency_s=args.latency_ms / 1000)
    print(server.base_url, flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
