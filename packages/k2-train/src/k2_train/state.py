"""Train state: named stateful components saved atomically, loaded for an exact resume.

A run's state is whatever the caller names: typically `model`, `optimizer` (with MuonClip's
QK-Clip extras), `scheduler`, `loader` (its position), `rng` and `trainer` (the step). Each
component has `state_dict()` / `load_state_dict()`; `ModelState`, `OptimizerState` and `RNGState`
adapt the ones that need the process group or the global RNG.

On disk: `RUN/state/step_NNNNNN/state.pt` holding `{"format", "version", "step", "world_size",
"layout", "meta", "components": {name: state_dict}}`. A save is written under a temporary name and renamed
into place, then `RUN/state/latest` (a one-line file, itself replaced atomically) names it, so an
interrupt at any moment leaves the previous state or the new one, never half of one. Under FSDP2
the model and optimizer are gathered to full, name-keyed state dicts on rank 0 (a collective every
rank joins; only rank 0 writes), so a multi-process run's state exports like a single-process one
and resumes with the same number of processes.

("checkpoint" in this repository means k2-ckpt's weight broadcast or HF weight files; a
training run's resumable snapshot is its train state.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from k2_train import distributed as dd

FORMAT = "k2-train-state"
VERSION = 1
STATE_DIR = "state"
LATEST = "latest"
STATE_FILE = "state.pt"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """The model's full state (a collective under FSDP2)."""

    def __init__(self, model: nn.Module, info: dd.DistInfo = dd.SINGLE_PROCESS) -> None:
        self.model, self.info = model, info

    def state_dict(self) -> dict[str, Any]:
        return dd.full_model_state_dict(self.model, self.info)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dd.load_full_model_state(self.model, state_dict, self.info)


class OptimizerState:
    """The optimizer's full, parameter-name-keyed state (a collective under FSDP2)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, info: dd.DistInfo = dd.SINGLE_PROCESS
    ) -> None:
        self.model, self.optimizer, self.info = model, optimizer, info

    def state_dict(self) -> dict[str, Any]:
        return dd.full_optimizer_state_dict(self.model, self.optimizer, self.info)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        dd.load_full_optimizer_state(self.model, self.optimizer, state_dict, self.info)


class RNGState:
    """torch's global generators (CPU, and CUDA where present). Rank 0's state is saved and every
    rank restores it, which equals what each rank had: they are seeded alike and draw alike."""

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


def state_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATE_DIR


def latest_state(run_dir: str | Path) -> Path | None:
    """The newest complete state directory of a run, or None."""
    root = state_root(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


def read_state(path: str | Path) -> dict[str, Any]:
    """A saved state (a `step_*` directory or a run directory, meaning its latest state)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file() and (state_root(path) / LATEST).is_file():
        latest = latest_state(path)
        path = latest if latest is not None else path
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file} not found: not a complete k2 train state")
    state = torch.load(state_file, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{state_file}: not a {FORMAT} file")
    if state.get("version") != VERSION:
        raise ValueError(
            f"{state_file}: {FORMAT} version {state.get('version')!r}, this k2-train reads {VERSION}"
        )
    return state


class TrainState:
    """Save and restore the named components of a run in `run_dir`."""

    def __init__(
        self,
        run_dir: str | Path,
        components: dict[str, Stateful],
        info: dd.DistInfo = dd.SINGLE_PROCESS,
        meta: dict[str, Any] | None = None,
        keep: int = 2,
        layout: dict[str, int] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.components = components
        self.info = info
        self.meta = meta or {}
        self.keep = keep
        # Parallel layout beyond the process count (e.g. {"ep": 2}): saved, and a resume with
        # another layout is refused by name.
        self.layout = dict(layout or {})

    def save(self, step: int) -> Path | None:
        """Every rank calls this (the state dicts may be collectives); rank 0 writes. Returns the
        state directory on rank 0."""
        payload = {
            "format": FORMAT,
            "version": VERSION,
            "step": int(step),
            "world_size": self.info.world_size,
            "layout": self.layout,
            "meta": self.meta,
            "components": {name: c.state_dict() for name, c in self.components.items()},
        }
        if not self.info.is_main:
            return None
        root = state_root(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step_{step:06d}"
        tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(payload, tmp / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root / LATEST)
        done = sorted(p for p in root.glob("step_*") if p.is_dir())
        for old in done[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        return latest_state(self.run_dir)

    def load(self, path: str | Path | None = None) -> int:
        """Restore every component from `path` (default: the run's latest state); returns the step.

        Refuses a state written by a different number of processes or layout (`--ep`), and one
        that lacks a component this run has (naming it)."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise FileNotFoundError(
                f"{self.run_dir}: no complete train state under {state_root(self.run_dir)}"
            )
        state = read_state(path)
        saved_layout = state.get("layout", {})
        for key in sorted(set(saved_layout) | set(self.layout)):
            was, now = saved_layout.get(key, 1), self.layout.get(key, 1)
            if was != now:
                raise ValueError(
                    f"{path}: the state was written with --{key} {was}; resume it with the same "
                    f"layout (now --{key} {now})"
                )
        if int(state["world_size"]) != self.info.world_size:
            raise ValueError(
                f"{path}: the state was written by {state['world_size']} process(es); "
                f"resume it with the same number (now {self.info.world_size})"
            )
        saved = state["components"]
        missing = [name for name in self.components if name not in saved]
        if missing:
            raise ValueError(
                f"{path}: the saved state has no {', '.join(missing)} (it holds {', '.join(saved)})"
            )
        for name, component in self.components.items():  # in order: the model before its optimizer
            component.load_state_dict(saved[name])
        return int(state["step"])


__all__ = [
    "ModelState",
    "OptimizerState",
    "RNGState",
    "Stateful",
    "TrainState",
    "latest_state",
    "read_state",
    "state_root",
]
