"""The engine bridge: one `EngineThread` shared by every request, awaited from asyncio.

The engine thread hands each request's `StepOutput`s to the event loop (`call_soon_threadsafe`
onto an asyncio.Queue): no thread blocks per stream, so 32 streams cost the loop one wake-up per
step, not 32 thread hand-offs through the GIL. Structured output
(forced tool calls, `response_format`) is a logits processor of the request, batched like any other.
Weight updates (`update_weights`) run between two steps: requests already running keep their cache,
the prefix cache is flushed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, EngineThread, SamplingParams, StepOutput

from k2_stack.serve.guided import JsonProcessor, ToolCallProcessor, json_grammar, llg_tokenizer, tool_grammars
from k2_stack.serve.metrics import ServeMetrics

log = logging.getLogger("k2.serve")


class _LoopQueue:
    """A request's outputs, put by the engine thread, awaited on the event loop. A step's outputs
    for every stream of one loop arrive in one `call_soon_threadsafe` (`put_batch`): one wake-up
    of the loop per step, whatever the number of streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._q = loop, asyncio.Queue()
        self.batch_key = loop

    def put(self, item: Any) -> None:  # on the engine thread
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item)
        except RuntimeError:  # the loop closed (server shutting down): nobody is reading
            pass

    @classmethod
    def put_batch(cls, items: list[tuple[_LoopQueue, Any]]) -> None:  # on the engine thread
        def deliver() -> None:
            for q, item in items:
                q._q.put_nowait(item)

        try:
            items[0][0]._loop.call_soon_threadsafe(deliver)
        except RuntimeError:
            pass

    async def get(self) -> Any:
        return await self._q.get()


@dataclass
class ServeConfig:
    served_model_name: str
    max_batch_size: int = 32
    max_model_len: int | None = None
    seed: int = 0
    kv_cache_tokens: int | None = None  # the KV memory budget (None: max_batch_size full-length sequences)
    block_size: int = 16
    max_prefill_tokens: int = 2048  # prompt tokens per step; longer prompts are prefilled in chunks
    enable_prefix_caching: bool = True
    log_stats_interval: float = 10.0  # seconds between summary lines in the log (0: off)
    chat_template: str = "k2"  # k2_data.chat template name the prompts are rendered with
    normalize_ids: bool = True  # rename tool-call ids to functions.NAME:IDX before rendering


class EngineBridge:
    """Owns the model, tokenizer, and the engine thread; the server's only way to the model."""

    def __init__(self, model: K2ForCausalLM, tokenizer: Any, config: ServeConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        stop_ids = {tokenizer.eos_id, tokenizer.token_to_id("<|im_end|>")}
        if model.config.eos_token_id is not None:
            stop_ids.add(model.config.eos_token_id)
        self.engine = Engine(
            model, max_batch_size=config.max_batch_size, max_model_len=config.max_model_len,
            detokenize=lambda ids: tokenizer.decode(ids), eos_token_ids=sorted(stop_ids), seed=config.seed,
            kv_cache_tokens=config.kv_cache_tokens, block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching, max_prefill_tokens=config.max_prefill_tokens,
        )  # fmt: skip
        self.max_model_len = self.engine.max_model_len
        self.runner = EngineThread(self.engine)
        self.metrics = ServeMetrics(config.served_model_name)
        self._lltok = None  # built on the first structured request (about 50 ms)
        self.num_aborted = 0  # requests whose consumer went away before they finished
        self._closed = threading.Event()
        if config.log_stats_interval > 0:
            threading.Thread(target=self._log_stats, name="k2-serve-stats", daemon=True).start()

    @property
    def lltok(self) -> Any:
        if self._lltok is None:
            self._lltok = llg_tokenizer(self.tokenizer)
        return self._lltok

    def json_processor(self, schema: Any, strict: bool = True) -> JsonProcessor:
        """A processor constraining the reply to `schema` (ValueError naming the problem when it is invalid)."""
        return JsonProcessor(
            self.lltok, self.model.config.vocab_size, self.tokenizer.eos_id, json_grammar(schema, strict)
        )

    def tool_call_processor(
        self, tools: list[dict[str, Any]], name: str | None, call_index: int
    ) -> ToolCallProcessor:
        """A processor forcing one call of `tools` (of `name`, when given); ValueError for a bad schema or name."""
        grammars = tool_grammars(tools)
        if name is not None and name not in grammars:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools {sorted(grammars)}")
        return ToolCallProcessor(
            self.lltok, self.tokenizer, self.model.config.vocab_size, grammars, name, call_index
        )

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """StepOutputs of one request (all its `params.n` samples); aborts it if the consumer goes away.
        Records time to first token (per request) and inter-token latency (per sample)."""
        t0 = time.perf_counter()
        q = _LoopQueue(asyncio.get_running_loop())
        rid, _ = self.runner.submit(prompt_ids, params, out=q)
        remaining = params.n
        last: dict[int, float] = {}
        try:
            while remaining:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                if out.token_ids:
                    now = time.perf_counter()
                    if not last:
                        self.metrics.ttft.observe(now - t0)
                    elif out.index in last:
                        self.metrics.itl.observe(now - last[out.index])
                    last[out.index] = now
                if out.finished:
                    remaining -= 1
                    self.metrics.request_finished(out.finish_reason or "stop")
                yield out
        finally:
            if remaining:
                self.num_aborted += 1
                self.runner.abort(rid)

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.runner.call_between_steps(fn))

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> Any:
        """Copy tensors into the live model between two decode steps (blocking); the Future's result.
        The engine flushes its prefix cache after it (rows of the old weights are never reused)."""

        def load() -> list[str]:
            params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
            unknown = sorted(set(state_dict) - set(params))
            if unknown:
                raise KeyError(f"update_weights: names not in the model: {unknown[:5]}")
            for k, v in state_dict.items():
                if params[k].shape != v.shape:
                    raise ValueError(
                        f"update_weights: {k} has shape {tuple(v.shape)}, model has {tuple(params[k].shape)}"
                    )
                params[k].copy_(v)
            return sorted(state_dict)

        return self.runner.call_between_steps(load).result()

    def _log_stats(self) -> None:
        last = None
        while not self._closed.wait(self.config.log_stats_interval):
            s = self.engine.stats
            now = (s.prompt_tokens, s.generated_tokens, self.engine.num_running, self.engine.num_waiting)
            if now != last:  # quiet while idle
                log.info("%s", self.metrics.summary(self.engine))
                last = now

    def close(self) -> None:
        self._closed.set()
        self.runner.close()


def default_threads() -> int:
    """`k2 serve`'s torch threads: the usable cores minus one (at least 1), leaving a core to the
    HTTP loop and detokenisation (on a 2-core machine two threads ran at half one thread's speed)."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


def serve_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The model dtype for `--dtype` on `device`; None: the checkpoint's own (auto on CUDA).
    auto on CPU: bf16 where bf16 GEMMs are native (AVX512-BF16 / AMX), else fp32."""
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"--dtype: expected auto, float32 or bfloat16, got {dtype!r}")
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type != "cpu":
        return None
    from k2_kernels import cpu_has_native_bf16

    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def describe_dtype(dtype: str, chosen: torch.dtype, device: torch.device) -> str:
    """`--dtype` as the startup line shows it: what was asked and, for auto, why."""
    name = str(chosen).removeprefix("torch.")
    if dtype != "auto":
        return name
    if device.type != "cpu":
        return f"{name} (auto: the checkpoint's dtype)"
    from k2_kernels import cpu_has_native_bf16

    why = "native bf16 GEMMs" if cpu_has_native_bf16() else "bf16 GEMMs not native on this CPU"
    return f"{name} (auto: {why})"


def build_bridge(
    model_dir: str | None,
    preset: str | None,
    served_model_name: str | None = None,
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    seed: int = 0,
    device: str | None = None,
    dtype: str = "float32",
    **engine: Any,
) -> EngineBridge:
    """A bridge for `--model DIR` (HF-format checkpoint; its tokenizer if it has one) or `--preset NAME`
    (random weights from `seed`, the shipped k2-data tokenizer). `device` None: CPU for a preset;
    for a checkpoint CUDA when available, else CPU. `dtype`: see `serve_dtype` (a preset's random
    init is drawn in fp32, then cast). `engine`: the other `ServeConfig` fields (kv_cache_tokens,
    block_size, enable_prefix_caching, ...)."""
    from pathlib import Path

    from k2_data import load_tokenizer

    if (model_dir is None) == (preset is None):
        raise ValueError("k2 serve: give exactly one of --model DIR or --preset NAME")
    from k2_model.device import pick_device

    if preset is not None:
        from k2_model.memory import check_fits

        config = K2Config.preset(preset)
        check_fits(config, f"--preset {preset}", weight_bytes=4)  # random init in fp32 on the CPU
        torch.manual_seed(seed)
        dev = pick_device(device or "cpu")
        model = K2ForCausalLM(config).to(dev)
        if (want := serve_dtype(dtype, dev)) is not None:
            model = model.to(want)
        tokenizer = load_tokenizer()
        name = served_model_name or preset
    else:
        d = Path(model_dir)
        if not d.is_dir():
            raise FileNotFoundError(
                f"--model {d}: no such directory (expected an HF-format export with config.json)"
            )
        if (d / "metrics.jsonl").is_file() or not any(d.glob("*.safetensors")):
            what = "a training run" if (d / "metrics.jsonl").is_file() else "not an HF-format export"
            raise FileNotFoundError(
                f"--model {d}: {what} (no model.safetensors / config.json export); "
                f"make a servable model with `k2 export {d} --out DIR` and pass --model DIR"
            )
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"--model {d}: no config.json (expected an HF-format export)")
        device = pick_device(device)
        model = K2ForCausalLM.from_pretrained(str(d), dtype=serve_dtype(dtype, device), device=device)
        has_tok = (d / "tokenizer.json").is_file() or (d / "tiktoken.model").is_file()
        tokenizer = load_tokenizer(d if has_tok else None)
        name = served_model_name or d.resolve().name
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids, model vocab_size is {model.config.vocab_size}"
        )
    return EngineBridge(
        model.eval(), tokenizer, ServeConfig(name, max_batch_size, max_model_len, seed, **engine)
    )
