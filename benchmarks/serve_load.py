"""Load test of `k2 serve` (and, with `--anchor transformers`, of `transformers serve` on the same model).

    .venv/bin/python benchmarks/serve_load.py [--model DIR | --preset tiny] [--clients 8] [--requests 32]
        [--max-tokens 32] [--threads 2] [--followups 5] [--anchor none|transformers]

Workload (fixed by `--seed`): chat requests sharing one system prompt, multi-turn histories (turn k
resends turns 1..k-1, as agents do), every fourth request with tools; sent by `--clients`
concurrent clients, streamed (`stream_options.include_usage`). Reported per server: output
tokens/s (completion tokens / wall time of the whole run), time to first token and inter-token
latency (p50 / p99, client side), and the prefix-cache hit rate of the load run (from the
`/metrics` counters; transformers serve has no prefix cache). Each server first answers one
warm-up request, not measured. Then the follow-up test: a conversation of >= 1,000 tokens is
sent once, then a follow-up adding <= 64 tokens; its time to first token with prefix caching
against `--no-prefix-caching` (median of `--followups`).

`--preset tiny` saves the preset's random weights (seed 0) with the shipped tokenizer and the Kimi
chat template (`k2_data.chat.template`, what `k2 export` writes) into a temporary HF-format dir, so
both servers load the same files and prompt the model identically. transformers serve (the
`transformers serve` CLI, model preloaded) runs one request at a time (its `--continuous-batching`
fails on MLA in transformers 5.24); with `--anchor transformers` the script fails, printing the
tail of its log, when it does not start or answers with an error, and asserts that every output is
non-empty.
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
from bench_common import machine

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


def log_tail(proc: subprocess.Popen, n: int = 2000) -> str:
    """The end of a server's log (its stderr and stdout go to a temporary file, never to a pipe that a
    long run could fill and block)."""
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")[-n:]


def start(cmd: list[str], port: int, env: dict, timeout: float = 300) -> subprocess.Popen:
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0:3]} exited: {log_tail(proc, 500)}")
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


def prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, prefix-cache hit tokens) since the server started, from k2's `/metrics`."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        for name in ("k2:prompt_tokens_total", "k2:prefix_cache_hit_tokens_total"):
            if line.startswith((name + "{", name + " ")):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["k2:prompt_tokens_total"], values["k2:prefix_cache_hit_tokens_total"]


def warm_up(url: str, model: str) -> None:
    r = one(url, model, {"messages": [{"role": "user", "content": "warm up"}]}, 2)
    assert r["text"] or r["tokens"], "the warm-up request returned nothing"


def followup_ttft(url: str, model: str, seed: int, repeats: int = 5) -> float:
    """Median TTFT of a follow-up adding <= 64 tokens to a >= 1,000-token conversation (sent once before)."""
    rng = random.Random(seed + 1)
    times = []
    for k in range(repeats):
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
    ap.add_argument("--followups", type=int, default=5, help="repeats of the follow-up TTFT test (median)")
    ap.add_argument("--anchor", choices=["none", "transformers"], default="transformers")
    args = ap.parse_args()
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model
    if model_dir is None:
        import torch
        from k2_data import load_tokenizer
        from k2_data.chat.template import write_chat_template
        from k2_model import K2Config, K2ForCausalLM

        torch.manual_seed(0)
        model_dir = str(Path(tmp.name) / args.preset)
        K2ForCausalLM(K2Config.preset(args.preset)).save_pretrained(model_dir)
        load_tokenizer().save(model_dir)
        write_chat_template(model_dir)  # as `k2 export` does: transformers serve needs it
    bodies = workload(args.requests, args.seed)
    rows = []
    port = _free_port()
    proc = k2_server(model_dir, port, env, [])
    try:
        url = f"http://127.0.0.1:{port}"
        warm_up(url, "m")
        prompt0, hit0 = prefix_counters(url)
        k2 = load(url, "m", bodies, args.clients, args.max_tokens)
        prompt1, hit1 = prefix_counters(url)
        k2["hit"] = (hit1 - hit0) / max(1.0, prompt1 - prompt0)
        ttft_cached = followup_ttft(url, "m", args.seed, args.followups)
    finally:
        proc.terminate()
        proc.wait(30)
    rows.append(("k2 serve", k2))
    port = _free_port()
    proc = k2_server(model_dir, port, env, ["--no-prefix-caching"])
    try:
        ttft_uncached = followup_ttft(f"http://127.0.0.1:{port}", "m", args.seed, args.followups)
    finally:
        proc.terminate()
        proc.wait(30)
    failure = None
    if args.anchor == "transformers":
        import transformers

        port = _free_port()
        exe = str(Path(sys.executable).parent / "transformers")
        # the model dir as FORCE_MODEL: loaded at start-up, not inside the first request's TTFT
        cmd = [exe, "serve", model_dir, "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        proc = None
        try:
            proc = start(cmd, port, env)
            url = f"http://127.0.0.1:{port}"
            warm_up(url, model_dir)
            hf = load(url, model_dir, bodies, args.clients, args.max_tokens)
            hf["hit"] = None  # no prefix cache: every request prefills its whole prompt
            rows.append((f"transformers serve {transformers.__version__}", hf))
        except (RuntimeError, AssertionError, httpx.HTTPError, OSError) as e:
            failure = f"transformers serve: not measured ({type(e).__name__}: {e})"
            if proc is not None:
                failure += f"\n--- its log (tail) ---\n{log_tail(proc)}"
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    print(f"machine: {machine(load=True)}")
    print(
        f"model {model_dir}; {args.requests} requests, {args.clients} clients, max_tokens {args.max_tokens}, "
        f"{args.threads} torch thread(s) per server"
    )
    print("| server | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | prefix hit rate | non-empty |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        hit = "none (no prefix cache)" if r["hit"] is None else f"{r['hit']:.1%}"
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['ttft_p50']:.3f} / {r['ttft_p99']:.3f} | "
            f"{r['itl_p50'] * 1000:.1f} / {r['itl_p99'] * 1000:.1f} | {hit} | {r['nonempty']}/{r['n']} |"
        )
    if len(rows) == 2:
        print(
            f"k2 serve / transformers serve output tokens/s: {rows[0][1]['tok_s'] / rows[1][1]['tok_s']:.1f}x"
        )
    print(
        f"follow-up TTFT (>= 1,000 cached, <= 64 new tokens): {ttft_cached * 1000:.0f} ms with prefix caching, "
        f"{ttft_uncached * 1000:.0f} ms without ({ttft_uncached / ttft_cached:.1f}x)"
    )
    if failure is not None:
        sys.exit(failure)
    for name, r in rows:
        assert r["nonempty"] == r["n"], f"{name} returned {r['n'] - r['nonempty']} empty outputs"


if __name__ == "__main__":
    main()
