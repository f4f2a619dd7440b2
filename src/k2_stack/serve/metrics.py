"""Serving metrics: Prometheus text for `GET /metrics` and a one-line summary for the log.

Names follow vLLM's (`k2:` instead of `vllm:`) so existing dashboards translate: requests running
and waiting, prompt / generation / prefilled / prefix-cached tokens, time to first token and
inter-token latency histograms, KV cache usage and the prefix-cache hit rate (cached prompt tokens
over prompt tokens). Counters of the engine are read, not copied: the engine owns them.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    1.0,
    2.5,
)


class Histogram:
    """A cumulative-bucket histogram (Prometheus semantics); thread-safe observe."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile q (None without observations)."""
        if self.count == 0:
            return None
        target, acc = q * self.count, 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts):
            acc += c
            if acc >= target:
                return bound
        return float("inf")

    def lines(self, name: str, labels: str) -> list[str]:
        out, acc = [], 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts):
            acc += c
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {acc}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class ServeMetrics:
    """What the server observes itself (latencies, finished requests); the rest comes from the engine."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}"'
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.finished: dict[str, int] = {}
        self._lock = threading.Lock()

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, engine: Any) -> str:
        """Prometheus text exposition (format 0.0.4)."""
        s, L = engine.stats, self.labels
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        rows: list[tuple[str, str, str, list[str]]] = [
            ("k2:num_requests_running", "gauge", "Sequences in the running batch.", [f"{{{L}}} {engine.num_running}"]),
            ("k2:num_requests_waiting", "gauge", "Requests waiting for admission.", [f"{{{L}}} {engine.num_waiting}"]),
            ("k2:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [f"{{{L}}} {s.prompt_tokens}"]),
            ("k2:generation_tokens_total", "counter", "Generated tokens.", [f"{{{L}}} {s.generated_tokens}"]),
            ("k2:prefill_tokens_total", "counter", "Prompt tokens run through prefill (not served from the prefix cache).", [f"{{{L}}} {s.prefilled_tokens}"]),
            ("k2:prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.", [f"{{{L}}} {s.cached_tokens}"]),
            ("k2:prefix_cache_hit_rate", "gauge", "Prefix-cached prompt tokens / prompt tokens since start.", [f"{{{L}}} {hit}"]),
            ("k2:kv_cache_usage_perc", "gauge", "Fraction of the KV cache budget held by running sequences.", [f"{{{L}}} {engine.cache_usage()}"]),
            ("k2:kv_cache_budget_tokens", "gauge", "KV cache budget in tokens.", [f"{{{L}}} {engine.cache.max_blocks * engine.cache.block_size}"]),
        ]  # fmt: skip
        with self._lock:
            finished = [f'{{{L},finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        rows.append(("k2:request_success_total", "counter", "Finished requests by finish reason.", finished))
        out = []
        for name, kind, help_, samples in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + [name + x for x in samples]
        for name, hist, help_ in (
            ("k2:time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
            ("k2:inter_token_latency_seconds", self.itl, "Time between two tokens of a sequence."),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *hist.lines(name, L)]
        return "\n".join(out) + "\n"

    def summary(self, engine: Any) -> str:
        """The log line: load, throughput counters, cache and latency quantiles."""
        s = engine.stats
        hit = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0

        def q(h: Histogram, p: float) -> str:
            v = h.quantile(p)
            return "-" if v is None else f"<={v * 1000:.0f}ms"

        return (
            f"running {engine.num_running} waiting {engine.num_waiting} | prompt {s.prompt_tokens} tok "
            f"(prefilled {s.prefilled_tokens}, prefix hit {hit:.1%}) generated {s.generated_tokens} tok | "
            f"kv cache {engine.cache_usage():.1%} | ttft p50 {q(self.ttft, 0.5)} p99 {q(self.ttft, 0.99)} | "
            f"itl p50 {q(self.itl, 0.5)} p99 {q(self.itl, 0.99)}"
        )
