"""`k2 serve` beside vLLM (CPU) on one model under the same load, rounds interleaved.

    .venv/bin/python benchmarks/serve_vs_vllm.py [--model DIR] [--rounds 5] [--loads 1x4,8x4,32x1]
        [--max-tokens 64] [--prompt-len 32] [--dtype float32|bfloat16] [--k2-threads N]
        [--servers k2,vllm] [--vllm-url URL]

Model: `--model DIR` (an HF export, e.g. `k2 export` of a `tiny-vllm` run), or by default the
`tiny-vllm` preset's random weights (seed 0) saved with `save_pretrained` and the shipped tokenizer
(`tiny-vllm` is the shape vLLM's CPU MLA backend takes: kv_lora_rank 512).

Load: for each `CxR` in `--loads`, C concurrent clients each send R streamed /v1/completions
requests one after another. Every prompt is `--prompt-len` random token ids, unique across rounds,
loads and requests (no prefix-cache hits); the two servers get the same prompts in a round. Replies
are `--max-tokens` greedy tokens with `ignore_eos` (every reply has the same length).
Measured client side: output tok/s (completion tokens / wall time of the load), mean time to first
token, and inter-token latency: per request (last chunk - first chunk) / (tokens - 1), the median
over requests (a server may send several tokens in one chunk, so gaps between chunks would not
compare).

Interleaving: both servers stay up; round k runs every load on both, the server order alternating
with k, so drift in the machine's load (shared cores) hits both alike. Reported per load: the
median over rounds of each server's numbers, and of the per-round k2 / vLLM tok/s ratio with its
range (min-max) over rounds. A wide range means a noisy machine: the ratio of one round compares
two runs seconds apart, the medians do not.

vLLM comes from `.venv-vllm` (`scripts/setup_vllm.sh`), started with the flags of docs/vllm.md, or
is a server already running at `--vllm-url`. `--servers k2` measures k2 serve alone (no vLLM).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_common import cpu_flags, machine
from k2_rl.vllm_rollout import vllm_cpu_flags

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MAX_MODEL_LEN = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_loads(text: str) -> list[tuple[int, int]]:
    """ "1x4,8x4" -> [(1, 4), (8, 4)] (clients x requests per client)."""
    out = []
    for part in text.split(","):
        try:
            c, r = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--loads: {part!r} is not CLIENTSxREQUESTS (e.g. 8x4)") from None
        if c < 1 or r < 1:
            raise SystemExit(f"--loads: {part!r} needs at least 1 client and 1 request")
        out.append((c, r))
    return out


class Server:
    def __init__(self, name: str, url: str, model: str, proc: subprocess.Popen | None, log) -> None:
        self.name, self.url, self.model, self.proc, self.log = name, url, model, proc, log

    def log_tail(self, n: int = 3000) -> str:
        if self.log is None:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):  # the server and its engine processes
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _launch(name: str, cmd: list[str], port: int, env: dict, model: str, timeout: float) -> Server:
    log = tempfile.TemporaryFile()  # never a pipe: a long run could fill it and block the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(name, f"http://127.0.0.1:{port}", model, proc, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} while starting:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not start within {timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.5)


def start_k2(model_dir: str, args: argparse.Namespace) -> Server:
    port = _free_port()
    cmd = [sys.executable, "-m", "k2_stack", "serve", "--model", model_dir, "--port", str(port)]
    cmd += ["--served-model-name", "m", "--device", "cpu", "--log-stats-interval", "0"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", str(args.max_batch_size)]
    cmd += ["--dtype", args.dtype]
    if args.k2_threads is not None:
        cmd += ["--threads", str(args.k2_threads)]
    return _launch("k2 serve", cmd, port, dict(os.environ), "m", 300)


def start_vllm(model_dir: str, args: argparse.Namespace) -> Server:
    if args.vllm_url:
        return Server("vLLM", args.vllm_url.rstrip("/"), args.vllm_model or model_dir, None, None)
    if not VLLM_PY.exists():
        raise SystemExit(f"no {VLLM_PY}: run scripts/setup_vllm.sh, pass --vllm-url, or --servers k2")
    port = _free_port()
    cmd = [
        str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
        "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(args.max_batch_size),
        *vllm_cpu_flags(args.dtype),  # PyTorch's RoPE op; CPU_MLA for fp32 (docs/vllm.md)
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
    return _launch("vLLM", cmd, port, env, "m", 600)


def make_model(tmp: str, preset: str) -> str:
    """The preset's random weights (seed 0) and the shipped tokenizer, in HF format."""
    import torch
    from k2_data import load_tokenizer
    from k2_model import K2Config, K2ForCausalLM

    torch.manual_seed(0)
    out = str(Path(tmp) / preset)
    K2ForCausalLM(K2Config.preset(preset)).save_pretrained(out)
    load_tokenizer().save(out)
    return out


async def one(client: httpx.AsyncClient, server: Server, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: client-side TTFT, gaps between text chunks, completion tokens."""
    body = {
        "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or []):
                last = time.perf_counter() - t0
                first = last if first is None else first
    ttft = first if first is not None else time.perf_counter() - t0
    itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else float("nan")
    return {"ttft": ttft, "itl": itl, "tokens": tokens}


async def run_load(server: Server, prompts: list[list[list[int]]], max_tokens: int) -> dict:
    """`prompts[c]`: the requests client c sends one after another."""
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:

        async def client_loop(mine: list[list[int]]) -> list[dict]:
            return [await one(client, server, p, max_tokens) for p in mine]

        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*(client_loop(m) for m in prompts)) for r in rs]
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in res)
    want = max_tokens * len(res)
    if tokens != want:
        raise RuntimeError(f"{server.name}: {tokens} completion tokens, expected {want} (ignore_eos)")
    return {
        "tok_s": tokens / wall,
        "ttft": statistics.fmean(r["ttft"] for r in res),
        "itl": statistics.median(r["itl"] for r in res),
    }


def prompts_for(seed: int, clients: int, per_client: int, length: int, vocab: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [
        [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(per_client)]
        for _ in range(clients)
    ]


def ratio_cell(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF-format model dir (default: tiny-vllm random weights)")
    ap.add_argument("--preset", default="tiny-vllm", help="the preset saved when --model is not given")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 5 for a table)")
    ap.add_argument("--loads", default="1x4,8x4,32x1", help="CLIENTSxREQUESTS per client, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32, help="random token ids per prompt")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of both servers")
    ap.add_argument("--max-batch-size", type=int, default=32, help="k2 --max-batch-size, vLLM --max-num-seqs")
    ap.add_argument("--k2-threads", type=int, default=None, help="k2 serve --threads (default: its own)")
    ap.add_argument("--servers", default="k2,vllm", help="k2,vllm or k2 (k2 serve alone)")
    ap.add_argument("--vllm-url", default=None, help="a vLLM already serving the same model")
    ap.add_argument("--vllm-model", default=None, help="the model name at --vllm-url (default: --model)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [s.strip() for s in args.servers.split(",")]
    if not names or set(names) - {"k2", "vllm"} or "k2" not in names:
        raise SystemExit(f"--servers: expected k2,vllm or k2, got {args.servers!r}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds: must be >= 1, got {args.rounds}")
    loads = parse_loads(args.loads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = args.model or make_model(tmp.name, args.preset)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    vocab = min(vocab, 7900)  # ordinary tokens of the shipped tokenizer (its specials sit above)

    servers: list[Server] = []
    try:
        servers.append(start_k2(model_dir, args))
        if "vllm" in names:
            servers.append(start_vllm(model_dir, args))
        for s in servers:  # one warm-up request each, not measured
            asyncio.run(run_load(s, [[[101, 102, 103]]], 4))
        results: dict[tuple[int, str], list[dict]] = {}
        for k in range(args.rounds):
            order = servers if k % 2 == 0 else servers[::-1]
            for j, (c, r) in enumerate(loads):
                prompts = prompts_for(args.seed * 1_000_003 + k * 1009 + j, c, r, args.prompt_len, vocab)
                for s in order:
                    results.setdefault((j, s.name), []).append(
                        asyncio.run(run_load(s, prompts, args.max_tokens))
                    )
            print(f"round {k + 1}/{args.rounds} done", file=sys.stderr)
    except RuntimeError as e:
        for s in servers:
            if s.proc is not None and s.proc.poll() is not None:
                print(f"--- {s.name} log (tail) ---\n{s.log_tail()}", file=sys.stderr)
        raise SystemExit(str(e)) from None
    finally:
        for s in servers:
            s.stop()

    print(f"machine: {machine(load=True)}; CPU flags: {' '.join(cpu_flags()) or 'none of ' + 'avx2/avx512'}")
    print(
        f"model {args.model or args.preset + ' (random weights)'}; {args.dtype}; {args.rounds} rounds, "
        f"server order alternating; prompts {args.prompt_len} random ids (unique); {args.max_tokens} greedy "
        f"tokens, ignore_eos, streamed; max batch {args.max_batch_size}; date {time.strftime('%Y-%m-%d', time.gmtime())}"
    )
    print(f"k2 serve --threads {args.k2_threads if args.k2_threads is not None else '(its default)'}")
    both = len(servers) == 2
    head = "| load | k2 tok/s |" + (" vLLM tok/s | k2 / vLLM tok/s (range) |" if both else "")
    head += (
        " TTFT mean (s) k2"
        + (" / vLLM |" if both else " |")
        + " ITL (ms) k2"
        + (" / vLLM |" if both else " |")
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for j, (c, r) in enumerate(loads):
        mine = results[(j, "k2 serve")]
        med = lambda rs, key: statistics.median(x[key] for x in rs)  # noqa: E731
        row = f"| {c} client{'s' if c > 1 else ''} x {r} | {med(mine, 'tok_s'):.0f} |"
        ttft, itl = f"{med(mine, 'ttft'):.3f}", f"{med(mine, 'itl') * 1000:.1f}"
        if both:
            theirs = results[(j, "vLLM")]
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(mine, theirs)]
            row += f" {med(theirs, 'tok_s'):.0f} | {ratio_cell(ratios)} |"
            ttft += f" / {med(theirs, 'ttft'):.3f}"
            itl += f" / {med(theirs, 'itl') * 1000:.1f}"
        print(f"{row} {ttft} | {itl} |")


if __name__ == "__main__":
    main()
