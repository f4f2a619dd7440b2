"""k2-ckpt's receiver inside `k2 serve`: a trainer pushes new weights into the live server.

`make_receiver_app` (k2_ckpt.api) is mounted at `/ckpt`, so a parameter server's `req_func` posts
`{"zmq_handles": {...}}` to `http://HOST:PORT/ckpt/v1/update_weights_from_ipc`. The loader is
k2-ckpt's `ModuleAdapter` over the served model, except that every load and the final commit run
on the engine thread between two decode steps (`call_between_steps`): a step never sees half an
update, and requests already running keep their cache from the old weights.
"""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI
from k2_ckpt.adapters import ModuleAdapter
from k2_ckpt.api import make_receiver_app
from k2_ckpt.device import device_id

from k2_stack.serve.bridge import EngineBridge


class BetweenStepsLoader:
    """A k2-ckpt `WeightLoader` whose loads run between two engine steps."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.bridge = bridge
        self.inner = ModuleAdapter(bridge.model)
        self.staging_pool = self.inner.staging_pool  # the receiver reuses staging buffers across updates

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.inner.validate(name, dtype, shape)

    def load_weights(self, named: Any) -> None:
        named = list(named)  # the tensors are staged already; only the copy waits for the boundary
        self.bridge.runner.call_between_steps(lambda: self.inner.load_weights(named)).result()

    def post_load(self) -> None:
        self.bridge.runner.call_between_steps(self.inner.post_load).result()

    def abort(self) -> None:  # the update was abandoned: only bookkeeping, no weights touched
        self.inner.abort()


def receiver_device_id(bridge: EngineBridge, rank: int = 0) -> str:
    """The key under which a parameter server addresses this receiver (k2_ckpt.device.device_id)."""
    return device_id(bridge.model.lm_head.weight.device, rank)


def mount_receiver(app: FastAPI, bridge: EngineBridge, rank: int = 0) -> str:
    """Mount the k2-ckpt receiver at /ckpt; returns its device id."""
    did = receiver_device_id(bridge, rank)
    app.mount("/ckpt", make_receiver_app(BetweenStepsLoader(bridge), did))
    return did
