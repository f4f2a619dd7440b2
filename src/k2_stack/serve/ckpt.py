"""k2-ckpt's receiver inside `k2 serve`: a trainer pushes new weights into the live server.

`make_receiver_app` (k2_ckpt.api) is mounted at `/ckpt`, so a parameter server's `req_func` posts
`{"zmq_handles": {...}}` to `http://HOST:PORT/ckpt/v1/update_weights_from_ipc`. The loader is
k2-ckpt's `BetweenStepsLoader` over the served model: every load and the final commit run on the
engine thread between two decode steps, so a step never sees half an update, and requests
already running keep their cache from the old weights.
"""

from __future__ import annotations

from fastapi import FastAPI
from k2_ckpt.adapters import BetweenStepsLoader
from k2_ckpt.api import make_receiver_app
from k2_ckpt.device import device_id

from k2_stack.serve.bridge import EngineBridge


def receiver_device_id(bridge: EngineBridge, rank: int = 0) -> str:
    """The key under which a parameter server addresses this receiver (k2_ckpt.device.device_id)."""
    return device_id(bridge.model.lm_head.weight.device, rank)


def mount_receiver(app: FastAPI, bridge: EngineBridge, rank: int = 0) -> str:
    """Mount the k2-ckpt receiver at /ckpt; returns its device id."""
    did = receiver_device_id(bridge, rank)
    loader = BetweenStepsLoader(bridge.model, bridge.runner.call_between_steps)
    app.mount("/ckpt", make_receiver_app(loader, did))
    return did
