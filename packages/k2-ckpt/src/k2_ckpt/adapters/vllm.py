"""vLLM integration: a worker extension receiving updates, and a req_func that triggers it.

Start vLLM with `--worker-extension-cls k2_ckpt.adapters.vllm.VllmWorkerExtension` and
`VLLM_SERVER_DEV_MODE=1` (for the `/collective_rpc` and `/reset_prefix_cache` routes); pass
`vllm_req_func("http://host:port")` to `ParameterServer.update`. vLLM is imported lazily:
this module imports without it.

Why not `model.load_weights` on the live model: after loading, vLLM repacks weights for its
kernels (on CPU, `dispatch_cpu_unquantized_gemm` replaces every linear `weight` with an empty
tensor and keeps a packed copy inside `layer.cpu_linear`; the lm_head keeps its weight but
also a packed copy; MLA derives W_UK/W_UV from kv_b_proj). A plain copy either fails on the
empty parameters or changes tensors the kernels no longer read. vLLM's layerwise reload
(`model_loader/reload`) puts every layer back in checkpoint format, loads, and re-runs each
layer's `process_weights_after_loading`, so the packed copies are rebuilt from the new weights.

All-or-nothing: the receiver stages the whole update (`staged=True`) and the extension checks
every name, shape and dtype against the checkpoint vLLM was started from, and that the update
is complete, before it touches the model. A failure after that (inside vLLM's reload) leaves
layers half-rebuilt, so the worker stops its process (vLLM's engine dies and its server exits)
instead of serving a mixed model. After each update the req_func resets vLLM's prefix cache:
cached KV from the old weights would otherwise be reused for repeated prompts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from k2_ckpt.device import device_id, pick_address
from k2_ckpt.errors import TensorMismatch
from k2_ckpt.worker import NamedTensors, update_weights_from_ipc

log = logging.getLogger(__name__)


def checkpoint_tensors(model_dir: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in the safetensors files of `model_dir`."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files to check updates against")
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                out[name] = (_DTYPES.get(sl.get_dtype(), torch.uint8), tuple(sl.get_shape()))
    return out


_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class VllmCheckpointLoader:
    """A `WeightLoader` for a live vLLM model: validates against the checkpoint's tensors and
    commits the staged update through vLLM's layerwise reload (see the module docstring)."""

    def __init__(self, model, model_config, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.model, self.model_config, self.expected = model, model_config, expected
        self.touched = False  # the model has been modified: a failure now leaves it unusable

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        want = self.expected.get(name)
        if want is None:
            raise TensorMismatch(f"tensor {name!r}: not in the checkpoint vLLM serves")
        if tuple(shape) != want[1]:
            raise TensorMismatch(f"tensor {name!r}: shape {tuple(shape)} sent, the checkpoint has {want[1]}")
        if dtype.is_floating_point != want[0].is_floating_point:
            raise TensorMismatch(f"tensor {name!r}: dtype {dtype} sent, the checkpoint has {want[0]}")

    def load_weights(self, named: NamedTensors) -> None:
        raise RuntimeError("the vLLM receiver runs staged only (staged=True): a direct load cannot be undone")

    def check_staged(self, names: list[str]) -> None:
        missing = sorted(set(self.expected) - set(names))
        if missing:  # a partial update would leave layers half-processed by the reload
            raise TensorMismatch(
                f"incomplete update: {len(missing)} of the checkpoint's {len(self.expected)} tensors "
                f"not sent (first: {missing[:3]}); nothing was loaded"
            )

    def commit_staged(self, named: NamedTensors) -> None:
        named = list(named)
        self.check_staged([n for n, _ in named])
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        self.touched = True
        with torch.no_grad():
            initialize_layerwise_reload(self.model)
            # the checkpoint-format parameters (not those processing derives, like MLA's W_UK_T)
            want = {n for n, _ in self.model.named_parameters()}
            loaded = self.model.load_weights(weights=iter(named))
            finalize_layerwise_reload(self.model, self.model_config)
            _repack_cpu_experts(self.model)
        if loaded is not None and (left := sorted(want - set(loaded))):
            raise RuntimeError(f"vLLM's load_weights left {len(left)} parameters unloaded: {left[:5]}")

    def post_load(self) -> None:
        pass


def _repack_cpu_experts(model) -> int:
    """Re-run the CPU MoE prepack that vLLM 0.32 skips on a weight update.

    `UnquantizedFusedMoEMethod._setup_kernel` calls `fused_experts.process_weights_after_loading`
    (on CPU: `cpu_prepack_moe_weight` into the grouped-GEMM layout) only the first time; on a
    reload it copies the new, unpacked weights into the packed parameters, and the CPU kernel
    then reads them as if packed (logprobs ~3e-2 off a fresh load of the same weights)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a build without CPU MoE kernels
        return 0
    n = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
            n += 1
    return n


class VllmWorkerExtension:
    """Mixed into vLLM's worker; `self.model_runner`, `self.model_config`, `self.device` and
    `self.rank` are the worker's own attributes."""

    _k2_expected: dict | None = None
    _k2_broken: str | None = None

    def update_weights_from_ipc(
        self, zmq_handles: dict[str, str], staged: bool = True, timeout_s: float = 300.0
    ) -> dict:
        if self._k2_broken:
            raise RuntimeError(f"this vLLM worker is stopping after a failed update: {self._k2_broken}")
        if not staged:
            raise ValueError("staged=False: the vLLM receiver stages every update (all-or-nothing)")
        dev = torch.device(self.device)  # type: ignore[attr-defined]
        me = device_id(dev, int(getattr(self, "rank", 0)))
        mc = self.model_config  # type: ignore[attr-defined]
        if self._k2_expected is None:
            self._k2_expected = checkpoint_tensors(mc.model)
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        loader = VllmCheckpointLoader(model, mc, self._k2_expected)
        try:
            res = update_weights_from_ipc(
                pick_address(zmq_handles, me),
                loader,
                device=dev,
                device_id=me,
                staged=True,
                timeout_s=timeout_s,
            )
        except BaseException as e:
            if loader.touched:
                self._stop(f"{type(e).__name__}: {e}")
            raise
        return dataclasses.asdict(res)

    def _stop(self, why: str) -> None:
        """The model may be half-reloaded: never serve it. Terminate this worker process; vLLM's
        executor sees it die and shuts the engine and the server down."""
        self._k2_broken = why
        log.critical("k2-ckpt: weight update failed after vLLM's model was modified (%s); stopping", why)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()


def vllm_req_func(base_url: str, timeout_s: float = 600.0) -> Callable[[dict[str, str]], None]:
    """req_func for `ParameterServer.update`: vLLM's `/collective_rpc` runs the extension on every
    worker, then `/reset_prefix_cache` drops KV computed with the old weights."""
    import httpx

    root = base_url.rstrip("/")

    def req(zmq_handles: dict[str, str]) -> None:
        r = httpx.post(
            root + "/collective_rpc",
            timeout=timeout_s,
            json={"method": "update_weights_from_ipc", "args": [zmq_handles]},
        )
        r.raise_for_status()
        reset_prefix_cache(root)

    return req


def reset_prefix_cache(base_url: str, attempts: int = 50) -> None:
    """POST /reset_prefix_cache until vLLM reports success (it refuses while requests hold blocks)."""
    import httpx

    for _ in range(attempts):
        r = httpx.post(base_url.rstrip("/") + "/reset_prefix_cache", timeout=60)
        r.raise_for_status()
        if r.headers.get("content-type", "").startswith("application/json") and not r.json().get(
            "success", True
        ):
            time.sleep(0.1)
            continue
        return
    raise RuntimeError(f"{base_url}: vLLM did not reset its prefix cache in {attempts} attempts")
