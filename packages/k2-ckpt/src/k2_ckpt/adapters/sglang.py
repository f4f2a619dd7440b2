"""SGLang integration: receive an update inside a `ModelRunner` (SGLang imported lazily).

Call `sglang_update_weights_from_ipc(model_runner, zmq_handles)` from the scheduler/TP worker
(e.g. a custom RPC handler); it uses only SGLang's public `ModelRunner.model.load_weights`
and `ModelRunner.device`/`gpu_id`, so nothing from SGLang is imported here.
"""

from __future__ import annotations

import dataclasses

import torch

from k2_ckpt.device import device_id, pick_address
from k2_ckpt.worker import FunctionLoader, update_weights_from_ipc


def sglang_update_weights_from_ipc(
    model_runner, zmq_handles: dict[str, str], *, staged: bool = False, timeout_s: float = 300.0
) -> dict:
    dev = (
        torch.device("cuda", int(model_runner.gpu_id))
        if hasattr(model_runner, "gpu_id")
        else torch.device(model_runner.device)
    )
    me = device_id(dev, 0)
    model = model_runner.model

    def post_hook() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    loader = FunctionLoader(lambda named: model.load_weights(list(named)), post_hook=post_hook)
    res = update_weights_from_ipc(
        pick_address(zmq_handles, me), loader, device=dev, device_id=me, staged=staged, timeout_s=timeout_s
    )
    return dataclasses.asdict(res)
