"""vLLM integration: a worker extension receiving updates, and a req_func that triggers it.

Start vLLM with `--worker-extension-cls k2_ckpt.adapters.vllm.VllmWorkerExtension` (and
`VLLM_SERVER_DEV_MODE=1` for the `/collective_rpc` route); pass
`vllm_req_func("http://host:port")` to `ParameterServer.update`. vLLM is imported lazily:
this module imports without it, and is exercised only where vLLM runs.

vLLM's own `model.load_weights` does the per-model renaming, sharding (TP) and fusing
(qkv, gate_up), so the receiver runs in direct mode by default: no model-sized staging copy
on the GPU, and a failed update reports exactly which tensors each worker loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from k2_ckpt.device import device_id, pick_address
from k2_ckpt.worker import FunctionLoader, update_weights_from_ipc


class VllmWorkerExtension:
    """Mixed into vLLM's GPU worker; `self.device`, `self.model_runner` and `self.model_config`
    are the worker's own attributes."""

    def update_weights_from_ipc(
        self, zmq_handles: dict[str, str], staged: bool = False, timeout_s: float = 300.0
    ) -> dict:
        dev = torch.device(self.device)  # type: ignore[attr-defined]
        me = device_id(dev, 0)
        model = self.model_runner.model  # type: ignore[attr-defined]

        def post_hook() -> None:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            process_weights_after_loading(model, self.model_config, dev)  # type: ignore[attr-defined]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        loader = FunctionLoader(lambda named: model.load_weights(weights=list(named)), post_hook=post_hook)
        res = update_weights_from_ipc(
            pick_address(zmq_handles, me),
            loader,
            device=dev,
            device_id=me,
            staged=staged,
            timeout_s=timeout_s,
        )
        return dataclasses.asdict(res)


def vllm_req_func(base_url: str, timeout_s: float = 600.0) -> Callable[[dict[str, str]], None]:
    """req_func for `ParameterServer.update`: vLLM's `/collective_rpc` runs the extension on every worker."""
    import httpx

    def req(zmq_handles: dict[str, str]) -> None:
        r = httpx.post(
            base_url.rstrip("/") + "/collective_rpc",
            timeout=timeout_s,
            json={"method": "update_weights_from_ipc", "args": [zmq_handles]},
        )
        r.raise_for_status()

    return req
