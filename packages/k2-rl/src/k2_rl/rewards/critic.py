"""Critics for the self-critique rubric reward: ``complete(requests) -> texts``.

A critic answers a batch of OpenAI chat-completions requests with the assistant text of each one
(``None`` for a request that failed after its retries; the rubric reward counts it as a tie and
reports it). Two implementations:

* :class:`HTTPCritic`: any OpenAI-compatible endpoint (``k2 serve``, vLLM, SGLang, a hosted API)
  through k2-data's :class:`~k2_data.agent.client.AsyncHTTPChatClient`, which brings bounded
  concurrency, retries with backoff and a persistent request cache (a resumed run re-asks the same
  questions and gets the same verdicts without paying for them again).
* :class:`PolicyCritic`: the policy itself through a ``generate(prompt_ids, ...)`` function (the
  RL loop's rollout engine, whose worker serves ``/generate`` on token ids, not an OpenAI chat
  endpoint): each request's messages are rendered in the Kimi chat format, sampled greedily, and
  decoded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Critic", "CriticStats", "HTTPCritic", "PolicyCritic", "endpoint_models"]


@dataclass
class CriticStats:
    requests: int = 0
    failures: int = 0
    cache_hits: int = 0
    errors: list[str] = field(default_factory=list)  # the first few failures' messages


class Critic(Protocol):
    stats: CriticStats

    def complete(self, requests: Sequence[dict]) -> list[str | None]:
        """The assistant text of each request, in order (``None``: the request failed)."""
        ...


def endpoint_models(base_url: str, timeout_s: float = 10.0, api_key: str | None = None) -> list[str]:
    """Model ids an OpenAI-compatible endpoint lists at ``GET {base_url}/models`` ([] if none)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/models", timeout=timeout_s, headers=headers)
    r.raise_for_status()
    return [str(m["id"]) for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]


class HTTPCritic:
    """A critic behind an OpenAI-compatible ``{base_url}/chat/completions``.

    Args:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model id sent in each request; ``None`` asks the endpoint (``GET /models``) and
            takes the first id it lists ("default" when it lists none or has no such route).
        max_concurrency: requests in flight at once.
        cache: a path to a k2-data ``RequestCache`` (SQLite) or ``None``.
        api_key, timeout_s, max_retries: passed to the client.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        max_concurrency: int = 8,
        cache: str | Path | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 2,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"critic URL must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.max_concurrency, self.api_key = max_concurrency, api_key
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self._cache_path = cache
        self._cache: Any = None
        self._model = model
        self.stats = CriticStats()

    @property
    def model(self) -> str:
        if self._model is None:
            try:
                ids = endpoint_models(self.base_url, api_key=self.api_key)
            except Exception:
                ids = []
            self._model = ids[0] if ids else "default"
        return self._model

    def _request_cache(self) -> Any:
        if self._cache is None and self._cache_path is not None:
            from k2_data.agent.client import RequestCache

            self._cache = RequestCache(self._cache_path)
        return self._cache

    def complete(self, requests: Sequence[dict]) -> list[str | None]:
        reqs = [{"model": self.model, **r} for r in requests]
        if not reqs:
            return []
        # one event loop per batch: the client's httpx pools belong to the loop they were made in
        return asyncio.run(self._complete(reqs))

    async def _complete(self, reqs: list[dict]) -> list[str | None]:
        from k2_data.agent.client import AsyncHTTPChatClient

        client = AsyncHTTPChatClient(
            self.base_url,
            self.api_key,
            max_concurrency=self.max_concurrency,
            cache=self._request_cache(),
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
        )
        try:
            answers = await asyncio.gather(*(client(r) for r in reqs), return_exceptions=True)
        finally:
            await client.aclose()
        self.stats.requests += len(reqs)
        self.stats.cache_hits += client.stats.cache_hits
        out: list[str | None] = []
        for a in answers:
            if isinstance(a, BaseException):
                if not isinstance(a, Exception):
                    raise a
                self.stats.failures += 1
                if len(self.stats.errors) < 5:
                    self.stats.errors.append(f"{type(a).__name__}: {a}")
                out.append(None)
            else:
                content = (a["choices"][0].get("message") or {}).get("content")
                out.append(content if isinstance(content, str) else None)
        return out

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None


class PolicyCritic:
    """The policy as its own critic, through the rollout engine's token-level ``generate``.

    ``generate(prompt_ids, n=1, temperature=0.0, max_tokens=..., seed=...)`` returns one list of
    samples (with ``token_ids``) per prompt, as :meth:`k2_rl.rollout.RolloutClient.generate` does;
    ``render(messages) -> ids`` renders a conversation with the generation prompt;
    ``decode(ids) -> str`` turns the sampled ids (stop tokens removed) into text.
    """

    def __init__(
        self,
        generate: Callable[..., Any],
        render: Callable[[list[dict]], list[int]],
        decode: Callable[[list[int]], str],
        stop_ids: Sequence[int] = (),
    ) -> None:
        self.generate, self.render, self.decode = generate, render, decode
        self.stop_ids = set(stop_ids)
        self.stats = CriticStats()

    def complete(self, requests: Sequence[dict]) -> list[str | None]:
        if not requests:
            return []
        prompts = [self.render(r["messages"]) for r in requests]
        first = requests[0]
        groups = self.generate(
            prompts,
            n=1,
            temperature=float(first.get("temperature", 0.0)),
            max_tokens=int(first.get("max_tokens", 256)),
            seed=int(first.get("seed", 0)),
        )
        self.stats.requests += len(requests)
        return [self.decode([t for t in g[0].token_ids if t not in self.stop_ids]) for g in groups]

    def close(self) -> None:
        pass
