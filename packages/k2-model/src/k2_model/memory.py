"""Will a model fit? Checked from the config before any tensor is allocated.

`--preset kimi-k2` on a 24 GiB machine otherwise spends most of a minute allocating before the
allocator fails with a raw error; this says up front how much the preset needs and how much the
machine has. The estimate is a lower bound (weights, and for training their gradients and the
optimizer's state), so a refusal is never wrong; passing it does not promise the run fits.
"""

from __future__ import annotations

import os

from k2_model.config import K2Config
from k2_model.stats import param_breakdown

__all__ = ["available_bytes", "check_fits", "needed_bytes"]

GIB = 1 << 30


def available_bytes(device_type: str = "cpu") -> int | None:
    """Memory this process may still take: MemAvailable (Linux) on CPU, free memory on CUDA;
    None when unknown."""
    if device_type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def needed_bytes(config: K2Config, weight_bytes: int, training: bool, world_size: int = 1) -> int:
    """A lower bound of one process's memory: the whole model as built before any sharding
    (`weight_bytes` per parameter), plus, for training, its gradient and one optimizer state per
    parameter (Muon's momentum; AdamW keeps two) shared over `world_size` ranks."""
    params = param_breakdown(config).total_params
    extra = 2 * weight_bytes * params // max(world_size, 1) if training else 0
    return params * weight_bytes + extra


def check_fits(
    config: K2Config, what: str, weight_bytes: int = 4, training: bool = False, device_type: str = "cpu"
) -> None:
    """ValueError naming `what` (e.g. "--preset kimi-k2") when the model cannot fit on this machine."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    have = available_bytes(device_type)
    if have is None:
        return
    have //= max(local, 1) if device_type == "cpu" else 1
    need = needed_bytes(config, weight_bytes, training, world)
    if need > have:
        params = param_breakdown(config).total_params
        role = "training" if training else "inference"
        raise ValueError(
            f"{what}: {params / 1e9:,.2f}B parameters need at least {need / GIB:,.1f} GiB per process "
            f"for {role} at {weight_bytes} bytes per weight; this machine has {have / GIB:,.1f} GiB "
            f"available{' per process' if local > 1 and device_type == 'cpu' else ''} "
            f"({device_type}). Use a smaller preset (e.g. --preset tiny) or more memory/processes."
        )
