"""The engine bridge: one `EngineThread` shared by every request, awaited from asyncio.

Each request's `StepOutput` queue is read on a thread of a private pool (the engine thread fills
it), so many concurrent streams never exhaust asyncio's small default executor. Guided tool calls
advance one token per `call_between_steps`, interleaved with the batched steps. Weight updates
(`update_weights`) also run between two steps: requests already running keep their cache.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from k2_model import K2Config, K2ForCausalLM
from k2_model.engine import Engine, EngineThread, SamplingParams, StepOutput

from k2_stack.serve.guided import GuidedCall, llg_tokenizer


@dataclass
class ServeConfig:
    served_model_name: str
    max_batch_size: int = 32
    max_model_len: int | None = None
    seed: int = 0


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
        )  # fmt: skip
        self.max_model_len = self.engine.max_model_len
        self.runner = EngineThread(self.engine)
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="k2-serve-wait")
        self._lltok = None  # built on the first forced tool call (about 50 ms)
        self.num_aborted = 0  # requests whose consumer went away before they finished

    @property
    def lltok(self) -> Any:
        if self._lltok is None:
            self._lltok = llg_tokenizer(self.tokenizer)
        return self._lltok

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """StepOutputs of one request; aborts it if the consumer goes away."""
        rid, q = self.runner.submit(prompt_ids, params)
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while not finished:
                try:
                    out = q.get_nowait()
                except queue.Empty:
                    out = await loop.run_in_executor(self._pool, q.get)
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.num_aborted += 1
                self.runner.abort(rid)

    def guided_call(
        self,
        prompt_ids: Sequence[int],
        tools: list[dict[str, Any]],
        name: str | None,
        call_index: int,
        max_tokens: int,
        temperature: float,
        seed: int | None,
    ) -> GuidedCall:
        return GuidedCall(
            self.model,
            self.tokenizer,
            self.lltok,
            prompt_ids,
            tools,
            name,
            call_index,
            max_tokens,
            self.max_model_len,
            temperature,
            seed,
        )

    async def run_guided(self, call: GuidedCall) -> AsyncIterator[list[int]]:
        """The token ids a guided call adds, one engine boundary at a time."""
        while not call.finished:
            yield await asyncio.wrap_future(self.runner.call_between_steps(call.step))

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.runner.call_between_steps(fn))

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> Any:
        """Copy tensors into the live model between two decode steps (blocking); the Future's result."""

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

    def close(self) -> None:
        self.runner.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def build_bridge(
    model_dir: str | None,
    preset: str | None,
    served_model_name: str | None = None,
    max_batch_size: int = 32,
    max_model_len: int | None = None,
    seed: int = 0,
    device: str | None = None,
) -> EngineBridge:
    """A bridge for `--model DIR` (HF-format checkpoint; its tokenizer if it has one) or `--preset NAME`
    (random weights from `seed`, the shipped k2-data tokenizer). `device` None: CPU for a preset;
    for a checkpoint CUDA when available (its dtype), else CPU in fp32 (this CPU's bf16 matmuls are slow)."""
    from pathlib import Path

    from k2_data import load_tokenizer

    if (model_dir is None) == (preset is None):
        raise ValueError("k2 serve: give exactly one of --model DIR or --preset NAME")
    if preset is not None:
        torch.manual_seed(seed)
        model = K2ForCausalLM(K2Config.preset(preset)).to(device or "cpu")
        tokenizer = load_tokenizer()
        name = served_model_name or preset
    else:
        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"k2 serve --model: {d} has no config.json")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.float32 if torch.device(device).type == "cpu" else None
        model = K2ForCausalLM.from_pretrained(str(d), dtype=dtype, device=device)
        has_tok = (d / "tokenizer.json").is_file() or (d / "tiktoken.model").is_file()
        tokenizer = load_tokenizer(d if has_tok else None)
        name = served_model_name or d.resolve().name
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids, model vocab_size is {model.config.vocab_size}"
        )
    return EngineBridge(model.eval(), tokenizer, ServeConfig(name, max_batch_size, max_model_len, seed))
