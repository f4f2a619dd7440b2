"""Devices named by users, checked before anything is allocated on them.

`pick_device("cuda")` on a CPU-only torch would otherwise fail deep inside the first `.to()` with
torch's `AssertionError: Torch not compiled with CUDA enabled`, and `torch.device("tpu")` with a
list of twenty device types k2 does not run on. Every entry point (pretrain, sft, rl, serve, chat)
resolves its `--device` here, so the message names the flag and what this machine offers.
"""

from __future__ import annotations

import torch

__all__ = ["DEVICE_CHOICES", "device_name_ok", "pick_device"]

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def device_name_ok(name: str | None) -> bool:
    """Whether `name` is spelled as a device k2 runs on (whether it exists here: `pick_device`)."""
    kind, sep, index = ("auto" if name is None else str(name).strip()).partition(":")
    if kind in ("auto", "cpu"):
        return not sep
    return kind == "cuda" and (not sep or index.isdigit())


def pick_device(name: str | None, flag: str = "--device") -> torch.device:
    """The torch.device for `name` ("auto"/None: CUDA when available, else CPU; "cpu"; "cuda";
    "cuda:N"), or ValueError naming `flag` when it is malformed or absent on this machine."""
    text = "auto" if name is None else str(name).strip()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not device_name_ok(text):
        raise ValueError(f"{flag} {text!r}: expected {DEVICE_CHOICES}")
    kind, _, index = text.partition(":")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) was built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
        )
        raise ValueError(f"{flag} {text}: {why}; use {flag} cpu (or auto)")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA device(s) (cuda:0..)"
        )
    return torch.device(text)
