"""Atomic, resumable training checkpoints.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding `state.pt` (model, optimizer,
scheduler, loader and RNG state). It is written under a temporary name and renamed into place, and
`checkpoints/latest` (a one-line file, itself replaced atomically) names the newest complete one,
so an interrupt at any moment leaves either the previous checkpoint or the new one, never half of
one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / LATEST)
    # Keep the newest `keep` checkpoints.
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = checkpoint_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_dir(run_dir) / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    state_file = path / "state.pt"
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} not found: not a complete k2 pretrain checkpoint")
    return torch.load(state_file, map_location="cpu", weights_only=False)
