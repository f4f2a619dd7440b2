"""Chat-completions clients: a function `request dict -> response dict`, over HTTP or anything else.

The agent loop only needs `client(request) -> response` where both are OpenAI chat-completions JSON
objects. `HTTPChatClient` posts to `{base_url}/chat/completions` with httpx (imported on first use, so
`import k2_data` stays light); tests and in-process servers can pass any callable instead.

Errors name the endpoint: `EndpointError(url, status, message)`; `status` is None when no HTTP response
came back (refused connection, timeout). 408/409/429/5xx and transport errors are retried
`max_retries` times with exponential backoff, honouring a numeric `Retry-After`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

Request = dict[str, Any]
Response = dict[str, Any]
ChatClient = Callable[[Request], Response]
AsyncChatClient = Callable[[Request], Awaitable[Response]]

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


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


class AsyncHTTPChatClient(_Base):
    """The asyncio twin of `HTTPChatClient`: `await client(request) -> response`."""

    def __init__(self, base_url: str, api_key: str | None = None, **kwargs: Any):
        super().__init__(base_url, api_key, **kwargs)
        self._client = self._httpx.AsyncClient(timeout=self._timeout, headers=self.headers)

    async def __call__(self, request: Request) -> Response:
        import asyncio

        body = json.dumps(request).encode()
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                r = await self._client.post(self.url, content=body)
            except self._httpx.TransportError as e:
                if last:
                    raise self._transport_error(e) from e
                await asyncio.sleep(_retry_delay(attempt, self.backoff_s, None))
                continue
            if r.status_code == 200:
                return _decode(self.url, r.status_code, r.content)
            if last or r.status_code not in RETRY_STATUSES:
                raise EndpointError(self.url, r.status_code, _error_message(r.content))
            await asyncio.sleep(_retry_delay(attempt, self.backoff_s, r.headers.get("retry-after")))
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> AsyncHTTPChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
