"""`PolicyEngine`: what k2 rl's loop samples from, and how the trainer's weights reach it.

The loop sees five operations: `start()`, `sync(tag)` (push the current policy; seconds taken),
`generate(prompts, **sampling)` (K samples per prompt, in prompt order), `free_cache()` (engine
switching: give the KV pool back while the trainer runs) and `close()`. This implementation drives
k2-model's engine either in a rollout worker process (`python -m k2_rl.rollout`), fed through
k2-ckpt's ParameterServer (a bucketed broadcast, as the checkpoint engine updates an inference
engine), or in this process (weights copied between two engine steps). Another engine plugs in
behind the same operations: `--rollout vllm` is a vLLM server (k2_rl.vllm_rollout), synced through
k2-ckpt's vLLM worker extension.

Under torchrun every rank calls every operation: rank 0 owns the engine, the others join the
collectives (the FSDP2 gather of the weights, k2-ckpt's broadcast, a restart's re-sync).
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from k2_train import distributed as dd

from k2_rl.config import RLConfig
from k2_rl.rollout import Rollout, RolloutWorker, Sample


def _rank0_requests(_mapping: dict) -> None:
    """The `req_func` of ranks other than 0 in k2-ckpt's update (which calls it on rank 0 only)."""


class PolicyEngine:
    """k2-model's engine for the loop's rollouts, in a worker process or in-process (see the module)."""

    def __init__(
        self,
        cfg: RLConfig,
        model: torch.nn.Module,
        tokenizer: Any,
        info: Any,
        device: torch.device,
        run_dir: Path,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.model, self.tok, self.info = cfg, model, tokenizer, info
        self.device, self.run_dir, self.log = device, run_dir, log
        self.worker: RolloutWorker | None = None  # the rollout process (None: in-process, or not rank 0)
        self.rollout: Any = None  # the client of the engine: `Rollout` or the worker's HTTP client
        self.ps: Any = None  # k2-ckpt's ParameterServer (None for the in-process engine)
        self.created_group = False  # a one-rank process group made for k2-ckpt's collectives

    @property
    def stop_ids(self) -> list[int]:
        return sorted({self.tok.eos_id, self.tok.token_to_id("<|im_end|>")})

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine (rank 0) and the parameter server (every rank, when weights travel)."""
        if self.info.is_main:
            self._start_engine()
        self._init_ps()

    def _start_engine(self) -> None:
        cfg = self.cfg
        if cfg.rollouts.rollout == "inprocess":
            engine_model = copy.deepcopy(self.model).eval()
            self.rollout = Rollout(engine_model, self.stop_ids, max_batch_size=64, seed=cfg.seed)
            return
        if cfg.rollouts.rollout == "vllm":
            self._start_vllm()
            return
        init_dir = self.run_dir / "rollout-init"  # the architecture and tokenizer the worker starts from
        if not (init_dir / "config.json").is_file():
            tmp = self.run_dir / ".rollout-init.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            if self.info.enabled:  # sharded: the architecture only, the first sync brings the weights
                from k2_model import K2ForCausalLM

                K2ForCausalLM(self.model.config).save_pretrained(str(tmp))
            else:
                self.model.save_pretrained(str(tmp))
            self.tok.save(tmp)
            os.replace(tmp, init_dir)
        self.worker = RolloutWorker(
            init_dir,
            device=str(self.device),
            threads=cfg.rollouts.rollout_threads,
            seed=cfg.seed,
            log_path=self.run_dir / "rollout.log",
            port=cfg.rollouts.rollout_port,
            qat_group_size=cfg.model.qat_group_size,  # --qat: sample from the quantised experts too
            qat_bits=cfg.model.qat_bits,
        )
        self.rollout = self.worker.start()
        self.log(f"rollout worker: pid {self.worker.pid} at {self.rollout.url}")

    def _start_vllm(self) -> None:
        """A vLLM server on an export of the current policy (k2_rl.vllm_rollout); every sync
        pushes the policy into it through k2-ckpt."""
        from k2_train.export import export_model

        from k2_rl.vllm_rollout import VllmServer

        if self.info.enabled:
            raise ValueError("--rollout vllm: one process only for now (not under torchrun)")
        init_dir = self.run_dir / "rollout-vllm"  # the export vLLM starts from (and checks pushes against)
        tok_dir = self.run_dir / ".rollout-vllm-tokenizer"
        self.tok.save(tok_dir)
        export_model(self.model, tok_dir, init_dir, force=True)
        self.worker = VllmServer(init_dir, self.stop_ids, self.run_dir / "vllm.log")
        self.rollout = self.worker.start()
        self.log(f"rollout engine: vLLM pid {self.worker.pid} at {self.rollout.url}")

    def _init_ps(self) -> None:
        if self.worker is None and not self.info.enabled:  # the in-process engine: no transfer
            return
        import torch.distributed as dist
        from k2_ckpt import ParameterServer
        from k2_ckpt.launch import free_port

        if not dist.is_initialized():  # a one-rank group for k2-ckpt's broadcast (its collectives)
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
            )
            self.created_group = True
        self.ps = ParameterServer()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        elif self.rollout is not None:
            self.rollout.close()
        if self.ps is not None:
            self.ps.close()
        if self.created_group:
            import torch.distributed as dist

            dist.destroy_process_group()
            gc.collect()  # its gloo threads joined now, not in static destructors (docs/training.md)
            self.created_group = False

    # -------------------------------------------------------------- the loop's operations
    def sync(self, tag: str) -> float:
        """Push the policy into the rollout engine; returns the seconds it took."""
        t0 = time.perf_counter()
        # under FSDP2 a collective whose full dict lands on rank 0 (the others register nothing)
        named = {k: v.detach().to("cpu") for k, v in dd.full_model_state_dict(self.model, self.info).items()}
        if self.ps is None:  # in-process engine: copy between two engine steps
            target = self.rollout.model
            self.rollout.thread.call_between_steps(lambda: target.load_state_dict(named)).result()
            return time.perf_counter() - t0
        if (
            self.cfg.rollouts.rollout == "vllm"
        ):  # the export's names (experts one by one), as vLLM loaded them
            from k2_rl.vllm_rollout import hf_named

            named = hf_named(named)
        name = f"policy-{tag}"
        self.ps.register_checkpoint(name, named_tensors=named)
        req = self.rollout.req_func if self.info.is_main else _rank0_requests
        try:
            self.ps.update(name, req, ranks=[0])
        finally:
            self.ps.unregister_checkpoint(name)
        return time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], **kw: Any) -> list[list[Sample]]:
        """Generate, restarting a dead worker once (with the current policy) before reporting.
        Under torchrun every rank enters (only rank 0's `prompts` count; the others get []), so
        that they all join the re-sync when rank 0 had to restart the worker (in one process the
        broadcast is a no-op)."""
        out: list[list[Sample]] = []
        restarted = False
        if self.info.is_main:
            try:
                out = self.rollout.generate(prompts, **kw)
            except Exception as e:
                if self.worker is None or not self.worker.exited(within_s=5.0):
                    raise
                self.log(f"the rollout worker died ({e!r}); restarting it with the current policy")
                self.rollout = self.worker.restart()
                restarted = True
        if not dd.broadcast_object(restarted, self.info):
            return out
        self.sync("restart")
        return self.rollout.generate(prompts, **kw) if self.info.is_main else []

    def generate_on_rank0(self, prompts: list[list[int]], **kw: Any) -> list[list[Sample]]:
        """Rank 0 alone, no collective (the policy critic scores on rank 0 only)."""
        return self.rollout.generate(prompts, **kw)

    def free_cache(self) -> dict[str, float]:
        """Engine switching: with the policy on a GPU (or `free_rollout_cache="on"`) the rollout
        engine gives its KV pool back before the trainer runs; the next rollout regrows it."""
        mode = self.cfg.rollouts.free_rollout_cache
        if self.rollout is None or mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return {}
        t0 = time.perf_counter()
        freed = self.rollout.free_cache_memory()
        return {"rollout_cache_freed_mb": freed / 2**20, "rollout_cache_free_s": time.perf_counter() - t0}

    def chat_url(self) -> str | None:
        """The rollout worker's own OpenAI API root, if it serves one (`GET /v1/models` answers)."""
        url = getattr(self.rollout, "url", None)
        if self.worker is None or url is None:
            return None
        import httpx

        try:
            ok = httpx.get(url + "/v1/models", timeout=5).status_code == 200
        except httpx.HTTPError:
            ok = False
        return url + "/v1" if ok else None


__all__ = ["PolicyEngine"]
