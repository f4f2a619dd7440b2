"""The rollout side of the RL loop: k2-model's engine sampling K responses per prompt, with new
weights arriving through k2-ckpt.

* `Rollout`: an Engine driven by an EngineThread in this process. `generate(prompts, n, ...)`
  queues one request with n samples per prompt (the engine prefills each prompt once and
  decodes its n samples from the shared cache; seeds are derived from the call's seed, the
  prompt's index and the sample's index, so a call's samples are the same whatever else runs
  and whatever the order of completion). Per-token log-probs under the raw
  model distribution come back with the tokens (logged against the trainer's own log-probs).
* `make_app(rollout)`: the worker's HTTP API (FastAPI): `GET /health`, `POST /generate`,
  `POST /free_cache` (release the KV pool while the trainer runs: engine switching), and
  k2-ckpt's receiver mounted at `/ckpt`, whose loads run between two engine steps
  (`k2_ckpt.adapters.BetweenStepsLoader`).
* `python -m k2_rl.rollout --model DIR --port P`: the worker process the loop starts by default.
* `RolloutClient(url)`: the trainer's side of that API; `RolloutWorker`: starts, watches and
  restarts the worker process (a worker that died is restarted or reported, never waited on
  forever). The worker is tied to the trainer (`k2_data.lifetime`): it dies with it, SIGKILL
  included, and each start takes a free port unless one is given (`--rollout-port`).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from k2_ckpt.launch import free_port  # one definition for the project
from k2_data import lifetime
from pydantic import BaseModel, Field


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]  # raw-distribution log-prob of each sampled token (the engine's)
    finish_reason: str  # "stop" | "length" | "abort"
    # the experts every forwarded position (prompt + response but its last token) was routed to,
    # int16 [positions, MoE layers, K], where the engine records them (k2_rl.routing)
    routed_experts: torch.Tensor | None = None


def derive_seed(*parts: Any) -> int:
    """A 62-bit seed from any parts (stable across processes and Python versions)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


class Rollout:
    """An engine in this process (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        seed: int = 0,
    ) -> None:
        from k2_model.engine import Engine
        from k2_model.engine.thread import EngineThread

        self.model = model.eval()
        self.engine = Engine(
            model,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            eos_token_ids=list(eos_token_ids),
            seed=seed,
            record_routes=True,  # the routing-mismatch metric and --routing-replay (k2_rl.routing)
        )
        self.thread = EngineThread(self.engine)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int = 0,
    ) -> list[list[Sample]]:
        from k2_model.engine import SamplingParams

        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        # one request per prompt with n samples: the engine prefills the prompt once and decodes
        # the n streams from its cache; sample i is seeded sample_seed(derive_seed(seed, p), i)
        pending = []
        for p, prompt in enumerate(prompts):
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=derive_seed(seed, p), n=n
            )
            pending.append(self.thread.submit(prompt, params))
        out: list[list[Sample]] = []
        for _, q in pending:
            samples: list[Sample | None] = [None] * n
            while any(s is None for s in samples):
                item = q.get(timeout=3600)
                if isinstance(item, BaseException):
                    raise RuntimeError(f"rollout engine failed: {item!r}") from item
                if item.finished:
                    c = item.completion
                    samples[item.index] = Sample(
                        list(c.token_ids), list(c.logprobs), c.finish_reason or "stop", c.routed_experts
                    )
            out.append(samples)  # in sample order, whatever the order of completion
        return out

    def free_cache_memory(self, timeout_s: float = 600.0) -> int:
        """Release the engine's KV pool between rollouts (engine switching: the trainer on the same
        device uses the memory during its update; the next generate regrows it). Bytes freed."""
        return int(self.thread.call_between_steps(self.engine.free_cache_memory).result(timeout_s))

    def loader(self):
        from k2_ckpt.adapters import BetweenStepsLoader

        return BetweenStepsLoader(self.model, self.thread.call_between_steps)

    def close(self) -> None:
        self.thread.close()


# ----------------------------------------------------------------------------- the worker's API


class GenerateRequest(BaseModel):
    prompts: list[list[int]] = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=64, ge=1)
    seed: int = 0


def _sample_json(s: Sample) -> dict:
    from k2_rl.routing import encode_routes

    return {
        "token_ids": s.token_ids, "logprobs": s.logprobs, "finish_reason": s.finish_reason,
        "routed_experts": encode_routes(s.routed_experts),
    }  # fmt: skip


def _sample_from_json(d: dict) -> Sample:
    from k2_rl.routing import decode_routes

    return Sample(**{**d, "routed_experts": decode_routes(d.get("routed_experts"))})


def make_app(rollout: Rollout, rank: int = 0):
    from fastapi import FastAPI
    from k2_ckpt.api import make_receiver_app
    from k2_ckpt.device import device_id

    app = FastAPI(title="k2-rl rollout worker")
    did = device_id(rollout.model.lm_head.weight.device, rank)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "pid": os.getpid(), "device_id": did}

    @app.post("/generate")
    def generate(req: GenerateRequest) -> dict:
        t0 = time.perf_counter()
        samples = rollout.generate(req.prompts, req.n, req.temperature, req.top_p, req.max_tokens, req.seed)
        return {
            "samples": [[_sample_json(s) for s in group] for group in samples],
            "seconds": time.perf_counter() - t0,
        }

    @app.post("/free_cache")
    def free_cache() -> dict:
        return {"freed_bytes": rollout.free_cache_memory()}

    app.mount("/ckpt", make_receiver_app(rollout.loader(), did))
    return app


def load_for_rollout(model_dir: str | Path, device: str = "cpu") -> tuple[Any, list[int]]:
    """The model of an HF-format dir (fp32 on CPU) and the stop ids of its tokenizer (EOS, <|im_end|>)."""
    from k2_data import load_tokenizer
    from k2_model import K2ForCausalLM

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model {d}: no config.json (an HF-format dir, e.g. from `k2 export`)")
    dtype = torch.float32 if torch.device(device).type == "cpu" else None
    model = K2ForCausalLM.from_pretrained(str(d), dtype=dtype, device=device)
    has_tok = (d / "tokenizer.json").is_file() or (d / "tiktoken.model").is_file()
    tok = load_tokenizer(d if has_tok else None)
    return model, sorted({tok.eos_id, tok.token_to_id("<|im_end|>")})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m k2_rl.rollout",
        description="k2-rl's rollout worker: "
        "k2-model's engine behind /generate, k2-ckpt's receiver at /ckpt.",
    )
    ap.add_argument("--model", required=True, help="HF-format model dir (the initial weights)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--qat-group-size",
        type=int,
        default=0,
        help="sample from the routed experts' INT4 weights (groups of this many inputs), as a policy "
        "trained with --qat int4 runs its forward (0: full precision)",
    )
    ap.add_argument("--qat-bits", type=int, default=4, help="the QAT bit width (with --qat-group-size)")
    args = ap.parse_args(argv)
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    model, stop_ids = load_for_rollout(args.model, args.device)
    if args.qat_group_size:  # the trainer's forward sees quantised experts: so must the sampler
        model.set_expert_qat(args.qat_group_size, args.qat_bits)
    rollout = Rollout(model, stop_ids, args.max_batch_size, args.max_model_len, args.seed)
    try:
        uvicorn.run(make_app(rollout), host=args.host, port=args.port, log_level="warning")
    finally:
        rollout.close()
    return 0


# ----------------------------------------------------------------------------- the trainer's side


class RolloutClient:
    """The trainer's view of a rollout worker's HTTP API."""

    def __init__(self, url: str, timeout_s: float = 3600.0) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout_s)

    def health(self) -> dict:
        r = self.http.get(self.url + "/health", timeout=5)
        r.raise_for_status()
        return r.json()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int = 0,
    ) -> list[list[Sample]]:
        body = {
            "prompts": [list(map(int, p)) for p in prompts],
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
        }
        r = self.http.post(self.url + "/generate", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"rollout worker {self.url}/generate: HTTP {r.status_code}: {r.text[:500]}")
        return [[_sample_from_json(s) for s in group] for group in r.json()["samples"]]

    def free_cache_memory(self) -> int:
        """The worker releases its KV pool (engine switching); bytes freed."""
        r = self.http.post(self.url + "/free_cache")
        if r.status_code != 200:
            raise RuntimeError(f"rollout worker {self.url}/free_cache: HTTP {r.status_code}: {r.text[:500]}")
        return int(r.json()["freed_bytes"])

    def req_func(self, zmq_handles: dict[str, str]) -> None:
        """k2-ckpt's `req_func`: make the worker's receiver pull the update."""
        r = self.http.post(self.url + "/ckpt/v1/update_weights_from_ipc", json={"zmq_handles": zmq_handles})
        r.raise_for_status()

    def close(self) -> None:
        self.http.close()


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding `port` fails as the worker's server would (SO_REUSEADDR, as uvicorn)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class RolloutWorker:
    """`python -m k2_rl.rollout` in a child process tied to this one (`k2_data.lifetime`: it dies
    with this process, SIGKILL included) on loopback `port`; 0 takes a free port at each start, so a
    restarted or resumed run never meets a port of an earlier one."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        threads: int = 0,
        seed: int = 0,
        log_path: str | Path | None = None,
        start_timeout_s: float = 300.0,
        port: int = 0,
        qat_group_size: int = 0,
        qat_bits: int = 4,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"--rollout-port {port}: expected 0 (a free port) or a port in 1..65535")
        self.model_dir, self.device, self.threads, self.seed = str(model_dir), device, threads, seed
        self.port, self.qat_group_size, self.qat_bits = port, qat_group_size, qat_bits
        self.log_path = Path(log_path) if log_path else None
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.client: RolloutClient | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> RolloutClient:
        if self.port and port_in_use(self.port):
            raise ValueError(
                f"--rollout-port {self.port}: the port is in use on 127.0.0.1 (another process holds it); "
                "give a free one, or 0 to take any free port"
            )
        port = self.port or free_port()
        cmd = [
            sys.executable,
            "-m",
            "k2_rl.rollout",
            "--model",
            self.model_dir,
            "--port",
            str(port),
            "--device",
            self.device,
            "--seed",
            str(self.seed),
        ]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.qat_group_size:
            cmd += ["--qat-group-size", str(self.qat_group_size), "--qat-bits", str(self.qat_bits)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = lifetime.spawn(
                cmd, stdout=log, stderr=subprocess.STDOUT if self.log_path else subprocess.PIPE
            )
        finally:
            if self.log_path:
                log.close()
        self.client = RolloutClient(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the rollout worker exited with code {self.proc.returncode} while starting"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            try:
                self.client.health()
                return self.client
            except Exception:
                time.sleep(0.2)
        self.close()
        raise TimeoutError(f"the rollout worker did not answer /health within {self.start_timeout_s:.0f} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self, within_s: float = 0.0) -> bool:
        """Whether the worker process has exited, waiting up to `within_s` for it: a killed
        process's sockets close (the client sees a reset) a moment before it can be reaped."""
        deadline = time.monotonic() + within_s
        while self.alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def restart(self) -> RolloutClient:
        self.close()
        self.restarts += 1
        return self.start()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


__all__ = [
    "Rollout",
    "RolloutClient",
    "RolloutWorker",
    "Sample",
    "derive_seed",
    "load_for_rollout",
    "make_app",
    "port_in_use",
]

if __name__ == "__main__":
    sys.exit(main())
