"""The pipeline side of `AsyncHTTPChatClient`: cache, bounded concurrency, retries, accounting.

Against `LoopbackServer`, a real HTTP server on 127.0.0.1 whose answers (status, latency, hangs) are
scripted per request, so each assertion is about what actually went over the wire."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("httpx")

from k2_data.agent.client import AsyncHTTPChatClient, EndpointError, RequestCache, cache_key
from k2_data.loopback import LoopbackServer, Reply


def req(text: str, seed: int = 0, **extra) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0.7,
        "seed": seed,
        **extra,
    }


def echo_upper(request: dict) -> Reply:
    return Reply(content=request["messages"][-1]["content"].upper())


def run(coro):
    return asyncio.run(coro)


def test_cache_key_covers_model_messages_params_seed_not_transport():
    base = cache_key(req("a"))
    assert cache_key(req("a")) == base
    assert cache_key(dict(reversed(list(req("a").items())))) == base  # key order does not matter
    assert cache_key(req("a", stream=False, user="u1")) == base  # transport-only fields are not keyed
    for other in (req("b"), req("a", seed=1), {**req("a"), "model": "m2"}, {**req("a"), "temperature": 0.0}):
        assert cache_key(other) != base


def test_persistent_cache_never_pays_twice(tmp_path):
    path = tmp_path / "cache.sqlite"
    with LoopbackServer(echo_upper) as server:

        async def first() -> tuple[list, dict]:
            async with AsyncHTTPChatClient(server.base_url, cache=path) as c:
                out = [await c(req("hello")), await c(req("hello")), await c(req("hello", seed=1))]
                return out, c.stats.as_dict()

        out, stats = run(first())
        assert [o["choices"][0]["message"]["content"] for o in out] == ["HELLO"] * 3
        assert len(server.requests) == 2  # the repeat was a hit; a new seed was not
        assert (stats["calls"], stats["cache_hits"], stats["http_requests"]) == (3, 1, 2)

        async def second() -> dict:  # a new process would see the same file
            async with AsyncHTTPChatClient(server.base_url, cache=path) as c:
                await c.map([req("hello"), req("hello", seed=1)])
                return c.stats.as_dict()

        stats2 = run(second())
        assert len(server.requests) == 2 and stats2["hit_rate"] == 1.0
    assert len(RequestCache(path)) == 2


def test_bounded_concurrency_and_order(tmp_path):
    with LoopbackServer(echo_upper, latency_s=0.1) as server:

        async def go() -> tuple[list, float, int]:
            async with AsyncHTTPChatClient(server.base_url, max_concurrency=4) as c:
                t0 = time.perf_counter()
                out = await c.map([req(f"r{i}") for i in range(16)], progress=True)
                return out, time.perf_counter() - t0, c.stats.max_in_flight

        out, dt, client_max = run(go())
    assert [o["choices"][0]["message"]["content"] for o in out] == [f"R{i}" for i in range(16)]
    assert server.max_in_flight == 4 and client_max == 4  # never more than the bound in flight
    assert 0.38 < dt < 1.5  # 16 requests / 4 slots x 0.1 s = 0.4 s ideal


def test_retries_429_with_retry_after_and_5xx_then_succeeds():
    seen: dict[str, int] = {}

    def flaky(request: dict) -> Reply:
        text = request["messages"][-1]["content"]
        seen[text] = seen.get(text, 0) + 1
        if seen[text] == 1:
            return Reply(
                status=429, body={"error": {"message": "slow down"}}, headers={"Retry-After": "0.05"}
            )
        if seen[text] == 2:
            return Reply(status=503, body={"error": {"message": "overloaded"}})
        return Reply(content="ok")

    with LoopbackServer(flaky) as server:

        async def go():
            async with AsyncHTTPChatClient(server.base_url, max_retries=3, backoff_s=0.01) as c:
                return await c(req("x")), c.stats

        out, stats = run(go())
    assert out["choices"][0]["message"]["content"] == "ok"
    assert len(server.requests) == 3 and (stats.retries, stats.http_requests, stats.failures) == (2, 3, 0)


def test_hung_request_times_out_and_is_retried():
    calls = []

    def hang_once(request: dict) -> Reply:
        calls.append(time.perf_counter())
        return Reply(hang=True) if len(calls) == 1 else Reply(content="answered")

    with LoopbackServer(hang_once) as server:

        async def go():
            async with AsyncHTTPChatClient(
                server.base_url, timeout_s=0.3, max_retries=1, backoff_s=0.01
            ) as c:
                return await c(req("x")), c.stats

        out, stats = run(go())
    assert out["choices"][0]["message"]["content"] == "answered"
    assert stats.retries == 1 and calls[1] - calls[0] >= 0.3


def test_errors_are_not_cached_and_4xx_not_retried(tmp_path):
    with LoopbackServer(
        lambda r: Reply(status=400, body={"error": {"message": "context too long"}})
    ) as server:

        async def go():
            async with AsyncHTTPChatClient(server.base_url, cache=tmp_path / "c.sqlite", max_retries=3) as c:
                with pytest.raises(EndpointError, match=r"HTTP 400: context too long") as e:
                    await c(req("x"))
                return e.value, c.stats

        err, stats = run(go())
    assert err.status == 400 and len(server.requests) == 1 and stats.failures == 1
    assert len(RequestCache(tmp_path / "c.sqlite")) == 0


def test_token_accounting_sums_usage():
    with LoopbackServer(lambda r: Reply(content="one two three")) as server:

        async def go():
            async with AsyncHTTPChatClient(server.base_url, max_concurrency=2) as c:
                await c.map([req(str(i)) for i in range(5)])
                return c.stats

        stats = run(go())
    assert stats.completion_tokens == 15 and stats.calls == 5  # the loopback counts words as tokens


def test_bad_arguments_name_themselves(tmp_path):
    with pytest.raises(ValueError, match="max_concurrency"):
        AsyncHTTPChatClient("http://127.0.0.1:1/v1", max_concurrency=0)
    bad = tmp_path / "not.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    with pytest.raises(ValueError, match="not.sqlite"):
        RequestCache(bad)
