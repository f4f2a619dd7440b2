"""Device identity and free memory, the two facts bucket planning and routing need."""

from __future__ import annotations

import os
import socket

import torch


def default_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        return torch.device("cuda", local)
    return torch.device("cpu")


def device_id(device: torch.device, rank: int) -> str:
    """A key the receiver on the same device can compute: the GPU's UUID, or host + rank on CPU."""
    if device.type == "cuda":
        return f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    return f"cpu:{socket.gethostname()}:{rank}"


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 32


def pick_address(zmq_handles: dict[str, str], my_device_id: str) -> str:
    """The ZMQ address meant for this device, with an error that lists what was offered."""
    try:
        return zmq_handles[my_device_id]
    except KeyError:
        raise KeyError(
            f"no ZMQ address for device {my_device_id!r}; the server offered {sorted(zmq_handles)}"
        ) from None
