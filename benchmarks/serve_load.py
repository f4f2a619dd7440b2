"""Load test of `k2 serve` (and, with `--anchor transformers`, of `transformers serve` on the same model).

    .venv/bin/python benchmarks/serve_load.py [--model DIR | --preset tiny] [--clients 8] [--requests 32]
        [--max-tokens 32] [--threads 2] [--anchor none|transformers]

Workload (fixed by `--seed`): chat requests sharing one system prompt, multi-turn histories (turn k
resends turns 1..k-1, as agents do), every fourth request with tools; sent by `--clients`
concurrent clients, streamed (`stream_options.include_usage`). Reported per server: output
tokens/s (completion tokens / wall time of the whole run), time to first token and inter-token
latency (p50 / p99, client side), and the prefix-cache hit rate from `/metrics`. Then the
follow-up test: a conversation of >= 1,000 tokens is sent once, then a follow-up adding <= 64
tokens; its time to first token with prefix caching against `--no-prefix-caching` (median of 5).

`--preset tiny` saves the preset's random weights (seed 0) with the shipped tokenizer into a
temporary HF-format dir so both servers load the same files. transformers serve runs one request
at a time (its `--continuous-batching` fails on MLA in transformers 5.24); it is skipped, with the
reason printed, when it does not start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

WORDS = "the of and to in is was for on with as by at from that this it be are or an which model data train token".split()
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = {"role": "system", "content": "You are a careful assistant. " + _text(rng, 150)}
    convs = [[system] for _ in range(max(1, n // 4))]
    out = []
    for i in range(n):
        conv = convs[i % len(convs)]
        conv.append({"role": "user", "content": _text(rng, rng.randint(10, 40))})
        body = {"messages": list(conv)}
        if i % 4 == 3:
            body["tools"] = [TOOL]
        out.append(body)
        conv.append({"role": "assistant", "content": _text(rng, rng.randint(10, 30))})
    return out


def start(cmd: list[str], port: int, env: dict, timeout: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0:3]} exited: {proc.stderr.read().decode()[-500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd[0:3]} did not start in {timeout} s")
        time.sleep(0.5)


def one(url: str, model: str, body: dict, max_tokens: int) -> dict:
    """Stream one chat request; client-side time to first token, inter-token gaps, completion tokens."""
    payload = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | body
    t0 = time.perf_counter()
    first, last, gaps, tokens, text = None, None, [], 0, ""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=payload, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("content") or d.get("tool_calls"):
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    else:
                        gaps.append(now - last)
                    last = now
                    text += d.get("content") or ""
    return {
        "ttft": first if first is not None else time.perf_counter() - t0,
        "gaps": gaps,
        "tokens": tokens,
        "text": text,
    }


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def load(url: str, model: str, bodies: list[dict], clients: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(lambda b: one(url, model, b, max_tokens), bodies))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in res)
    gaps = [g for r in res for g in r["gaps"]]
    return {
        "tok_s": tokens / wall,
        "ttft_p50": pct([r["ttft"] for r in res], 0.5),
        "ttft_p99": pct([r["ttft"] for r in res], 0.99),
        "itl_p50": pct(gaps, 0.5),
        "itl_p99": pct(gaps, 0.99),
        "nonempty": sum(bool(r["text"] or r["tokens"]) for r in res),
        "n": len(res),
    }


def hit_rate(url: str) -> float | None:
    try:
        for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
            if line.startswith("k2:prefix_cache_hit_rate"):
                return float(line.rsplit(" ", 1)[1])
    except httpx.HTTPError:
        return None
    return None


def followup_ttft(url: str, model: str, seed: int) -> float:
    """Median TTFT of a follow-up adding <= 64 tokens to a >= 1,000-token conversation (sent once before)."""
    rng = random.Random(seed + 1)
    times = []
    for k in range(5):
        conv = [
            {"role": "system", "content": _text(rng, 1100)},
            {"role": "user", "content": f"{k} " + _text(rng, 20)},
        ]
        first = one(url, model, {"messages": conv}, 4)
        conv += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": _text(rng, 30)}]
        times.append(one(url, model, {"messages": conv}, 4)["ttft"])
    return statistics.median(times)


def k2_server(model_dir: str, port: int, env: dict, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "k2_stack", "serve", "--model", model_dir, "--port", str(port)]
    cmd += [
        "--served-model-name",
        "m",
        "--log-stats-interval",
        "0",
        "--device",
        "cpu",
        "--max-model-len",
        "4096",
    ]
    return start(cmd + extra, port, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF-format model dir (from `k2 export`)")
    src.add_argument("--preset", default="tiny")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each server")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--anchor", choices=["none", "transformers"], default="transformers")
    args = ap.parse_args()
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        import torch
        from k2_data import load_tokenizer
        from k2_model import K2Config, K2ForCausalLM

        torch.manual_seed(0)
        model_dir = str(Path(tmp.name) / args.preset)
        K2ForCausalLM(K2Config.preset(args.preset)).save_pretrained(model_dir)
        load_tokenizer().save(model_dir)
    bodies = workload(args.requests, args.seed)
    rows = []
    port = _free_port()
    proc = k2_server(model_dir, port, env, [])
    try:
        url = f"http://127.0.0.1:{port}"
        k2 = load(url, "m", bodies, args.clients, args.max_tokens)
        k2["hit"] = hit_rate(url)
        ttft_cached = followup_ttft(url, "m", args.seed)
    finally:
        proc.terminate()
        proc.wait(30)
    rows.append(("k2 serve", k2))
    port = _free_port()
    proc = k2_server(model_dir, port, env, ["--no-prefix-caching"])
    try:
        ttft_uncached = followup_ttft(f"http://127.0.0.1:{port}", "m", args.seed)
    finally:
        proc.terminate()
        proc.wait(30)
    if args.anchor == "transformers":
        port = _free_port()
        exe = str(Path(sys.executable).parent / "transformers")
        try:
            proc = start([exe, "serve", "--port", str(port), "--device", "cpu"], port, env)
            try:
                hf = load(f"http://127.0.0.1:{port}", model_dir, bodies, args.clients, args.max_tokens)
                hf["hit"] = None
                rows.append(("transformers serve", hf))
            finally:
                proc.terminate()
                proc.wait(30)
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            print(f"transformers serve: not measured ({e})")
    print(
        f"model {model_dir}; {args.requests} requests, {args.clients} clients, max_tokens {args.max_tokens}"
    )
    print("| server | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | prefix hit rate | non-empty |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        hit = "-" if r["hit"] is None else f"{r['hit']:.1%}"
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
            f"{r['itl_p50'] * 1000:.1f} / {r['itl_p99'] * 1000:.1f} | {hit} | {r['nonempty']}/{r['n']} |"
        )
    if len(rows) == 2:
        print(
            f"k2 serve / transformers serve output tokens/s: {rows[0][1]['tok_s'] / rows[1][1]['tok_s']:.1f}x"
        )
        assert rows[1][1]["nonempty"] == rows[1][1]["n"], "transformers serve returned empty outputs"
    print(
        f"follow-up TTFT (>= 1,000 cached, <= 64 new tokens): {ttft_cached * 1000:.0f} ms with prefix caching, "
        f"{ttft_uncached * 1000:.0f} ms without ({ttft_uncached / ttft_cached:.1f}x)"
    )


if __name__ == "__main__":
    main()
