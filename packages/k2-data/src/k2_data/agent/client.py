"""Chat-completions clients: a function `request dict -> response dict`, over HTTP or anything else.

The agent loop only needs `client(request) -> response` where both are OpenAI chat-completions JSON
objects. `HTTPChatClient` posts to `{base_url}/chat/completions` with httpx (imported on first use, so
`import k2_data` stays light); tests and in-process servers can pass any callable instead.

Errors name the endpoint: `EndpointError(url, status, message)`; `status` is None when no HTTP response
came back (refused connection, timeout). 408/409/429/5xx and transport errors are retried
`max_retries` times with exponential backoff, honouring a numeric `Retry-After`.

`AsyncHTTPChatClient` is also the one client every synthesis pipeline (rephrasing, agentic data) uses:
bounded concurrency (`max_concurrency`), a persistent request cache (`cache=`, a `RequestCache` or a
path: a rerun never pays twice for the same request), token and request accounting (`stats`), and
`map(requests, progress=True)` for many requests under a rich progress bar.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Request = dict[str, Any]
Response = dict[str, Any]
ChatClient = Callable[[Request], Response]
AsyncChatClient = Callable[[Request], Awaitable[Response]]

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
# request fields that do not change what the model returns, left out of the cache key
POOL_SIZE = 8  # connections per httpx pool of a bounded AsyncHTTPChatClient (see __init__)
_UNKEYED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store"})


class EndpointError(RuntimeError):
    """The chat-completions endpoint failed: `url`, `status` (None without a response) and the reason."""

    def __init__(self, url: str, status: int | None, message: str):
        self.url, self.status, self.message = url, status, message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{url}: {where}: {message}")


def _import_httpx() -> Any:
    try:
        import httpx
    except ImportError as e:  # the `agent` extra
        raise ImportError("k2_data.agent's HTTP client needs httpx: pip install 'k2-data[agent]'") from e
    return httpx


def _error_message(body: bytes | str) -> str:
    """The `error.message` of an OpenAI error body, else the body itself (truncated)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
    text = text.strip()
    return (text[:500] + "...") if len(text) > 500 else (text or "(empty body)")


def _decode(url: str, status: int, content: bytes) -> Response:
    try:
        data = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EndpointError(url, status, f"response is not JSON ({e}): {content[:200]!r}") from None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list) or not data["choices"]:
        raise EndpointError(url, status, f"response has no choices: {json.dumps(data)[:300]}")
    return data


def _retry_delay(attempt: int, backoff_s: float, retry_after: str | None) -> float:
    if retry_after is not None:
        try:
            return min(float(retry_after), 60.0)
        except ValueError:  # an HTTP date: fall back to backoff
            pass
    return backoff_s * (2**attempt)


class _Base:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 2,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_retries < 0 or timeout_s <= 0:
            raise ValueError(f"need max_retries >= 0 and timeout_s > 0, got {max_retries}, {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        httpx = _import_httpx()
        self._timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self._httpx = httpx

    def _transport_error(self, e: Exception) -> EndpointError:
        kind = "timed out" if isinstance(e, self._httpx.TimeoutException) else "request failed"
        return EndpointError(self.url, None, f"{kind}: {type(e).__name__}: {e}")


class HTTPChatClient(_Base):
    """`client(request) -> response` against an OpenAI-compatible server.

    `base_url` is the API root, e.g. `http://127.0.0.1:8000/v1` (k2 serve, vLLM, SGLang) or
    `https://api.moonshot.ai/v1`. Use as a context manager, or call `close()`.
    """

    def __init__(self, base_url: str, api_key: str | None = None, **kwargs: Any):
        super().__init__(base_url, api_key, **kwargs)
        self._client = self._httpx.Client(timeout=self._timeout, headers=self.headers)

    def __call__(self, request: Request) -> Response:
        body = json.dumps(request).encode()
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                r = self._client.post(self.url, content=body)
            except self._httpx.TransportError as e:
                if last:
                    raise self._transport_error(e) from e
                time.sleep(_retry_delay(attempt, self.backoff_s, None))
                continue
            if r.status_code == 200:
                return _decode(self.url, r.status_code, r.content)
            if last or r.status_code not in RETRY_STATUSES:
                raise EndpointError(self.url, r.status_code, _error_message(r.content))
            time.sleep(_retry_delay(attempt, self.backoff_s, r.headers.get("retry-after")))
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> HTTPChatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cache_key(request: Request) -> str:
    """sha256 of the request's canonical JSON (model, messages, sampling params, seed, tools, ...).

    Transport-only fields (`stream`, `user`, ...) are left out; the endpoint URL is too, so a cache made
    against one server of a model serves another server of the same model."""
    keyed = {k: v for k, v in request.items() if k not in _UNKEYED_FIELDS}
    text = json.dumps(keyed, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class RequestCache:
    """A persistent `cache_key(request) -> response` map in one SQLite file.

    SQLite because it is in the standard library, commits atomically (a killed run never leaves a torn
    entry) and lets several processes share one cache file. Each `put` commits, so every answer paid for
    survives a crash."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, response TEXT NOT NULL, "
                "created REAL NOT NULL)"
            )
            self._db.commit()
        except sqlite3.DatabaseError as e:
            raise ValueError(f"request cache {self.path}: not a usable SQLite file ({e})") from e

    def get(self, key: str) -> Response | None:
        with self._lock:
            row = self._db.execute("SELECT response FROM responses WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, response: Response) -> None:
        text = json.dumps(response, ensure_ascii=False)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses (key, response, created) VALUES (?, ?, ?)",
                (key, text, time.time()),
            )
            self._db.commit()

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class ClientStats:
    """What a client did: calls, cache hits, HTTP attempts, retries, failures, tokens, concurrency."""

    calls: int = 0  # awaited requests, cache hits included
    cache_hits: int = 0
    http_requests: int = 0  # POSTs sent, retries included
    retries: int = 0
    failures: int = 0  # calls that raised after their retries
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0  # POSTs awaiting an answer now
    max_in_flight: int = 0
    first_error: str | None = None  # the first failed call's error (the server's answer)

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.calls if self.calls else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class AsyncHTTPChatClient(_Base):
    """The asyncio twin of `HTTPChatClient`: `await client(request) -> response`.

    Pipeline options (all off by default, so the agent loop sees the plain client):
    `max_concurrency` bounds the POSTs in flight (one semaphore across every caller of this client);
    `cache` (a `RequestCache` or a path to one) answers a request seen before without the network and
    stores every new answer; `stats` counts calls, hits, retries and the `usage` tokens reported.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        max_concurrency: int | None = None,
        cache: RequestCache | str | Path | None = None,
        **kwargs: Any,
    ):
        super().__init__(base_url, api_key, **kwargs)
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (or None for no bound), got {max_concurrency}")
        self.max_concurrency = max_concurrency
        if max_concurrency is None:
            self._client = self._httpx.AsyncClient(timeout=self._timeout, headers=self.headers)
            self._pools = [self._client]
            self._slots: asyncio.Queue | None = None
        else:
            # httpcore's pool does O(connections^2) work per request (measured: 64 connections in one pool
            # reach 14% of the ideal rate on 2 CPUs), so requests in flight are spread over small pools,
            # each of at most POOL_SIZE connections; a slot names the pool it may use
            n_pools = -(-max_concurrency // POOL_SIZE)
            limits = self._httpx.Limits(max_connections=POOL_SIZE, max_keepalive_connections=POOL_SIZE)
            self._pools = [
                self._httpx.AsyncClient(timeout=self._timeout, headers=self.headers, limits=limits)
                for _ in range(n_pools)
            ]
            self._client = self._pools[0]
            self._slots = asyncio.Queue()
            for i in range(max_concurrency):
                self._slots.put_nowait(i % n_pools)
        self._own_cache = cache is not None and not isinstance(cache, RequestCache)
        self.cache: RequestCache | None = (
            cache if isinstance(cache, RequestCache) or cache is None else RequestCache(cache)
        )
        self.stats = ClientStats()

    async def __call__(self, request: Request) -> Response:
        self.stats.calls += 1
        key = cache_key(request) if self.cache is not None else None
        if key is not None and (hit := self.cache.get(key)) is not None:
            self.stats.cache_hits += 1
            return hit
        try:
            if self._slots is None:
                response = await self._post(request, self._client)
            else:
                pool = await self._slots.get()
                try:
                    response = await self._post(request, self._pools[pool])
                finally:
                    self._slots.put_nowait(pool)
        except EndpointError as e:
            self.stats.failures += 1
            self.stats.first_error = self.stats.first_error or str(e)
            raise
        usage = response.get("usage") or {}
        self.stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        self.stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        if key is not None:
            self.cache.put(key, response)
        return response

    async def _post(self, request: Request, client: Any) -> Response:
        body = json.dumps(request).encode()
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            if attempt:
                self.stats.retries += 1
            self.stats.http_requests += 1
            self.stats.in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
            try:
                r = await client.post(self.url, content=body)
            except self._httpx.TransportError as e:
                if last:
                    raise self._transport_error(e) from e
                await asyncio.sleep(_retry_delay(attempt, self.backoff_s, None))
                continue
            finally:
                self.stats.in_flight -= 1
            if r.status_code == 200:
                return _decode(self.url, r.status_code, r.content)
            if last or r.status_code not in RETRY_STATUSES:
                raise EndpointError(self.url, r.status_code, _error_message(r.content))
            await asyncio.sleep(_retry_delay(attempt, self.backoff_s, r.headers.get("retry-after")))
        raise AssertionError("unreachable")

    async def map(
        self, requests: Iterable[Request], *, progress: bool = False, description: str = "requests"
    ) -> list[Response]:
        """Every request's response, in order, sent concurrently (bounded by `max_concurrency`);
        `progress=True` shows a rich bar with the cache hit rate and tokens so far. The first failure
        cancels the rest and raises."""
        reqs = list(requests)
        bar = _Bar(len(reqs), description, self.stats) if progress else None

        async def one(req: Request) -> Response:
            out = await self(req)
            if bar is not None:
                bar.advance()
            return out

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            if bar is not None:
                bar.close()

    async def aclose(self) -> None:
        for pool in self._pools:
            await pool.aclose()
        if self._own_cache and self.cache is not None:
            self.cache.close()

    async def __aenter__(self) -> AsyncHTTPChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Bar:
    """A rich progress bar over client calls (rich imported on use: only pipelines need it)."""

    def __init__(self, total: int, description: str, stats: ClientStats):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.stats = stats
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            transient=True,
        )
        self.task = self.progress.add_task(description, total=total, info="")
        self.progress.start()

    def advance(self) -> None:
        s = self.stats
        info = f"hits {s.hit_rate:.0%} | in flight {s.in_flight} | {s.completion_tokens:,} tokens out"
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()
