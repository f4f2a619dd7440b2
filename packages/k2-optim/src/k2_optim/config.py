"""Config components for what k2-optim builds, nested by the task configs (k2-train, k2-rl):
`OptimConfig` (which optimizer and its hyper-parameters) and `WSDConfig` (the warmup-stable-decay
schedule, as fractions of a run).

Fields carry their help text in dataclass metadata (`help`, optional `choices`), the form the
`k2` command generates its flags from; k2-optim sits below k2-train, so it writes that metadata
itself rather than importing k2-train's `option`."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

from .schedule import wsd_factor

OPTIMIZERS = ("muonclip", "muon", "adamw")
NS_DTYPES = ("auto", "fp32", "bf16")

# The QK-Clip threshold of the training commands. MuonClip's own default stays K2's 100 (a
# 1T-parameter model whose logits QK-Clip caps there); the paper's small-scale ablation used 30,
# and at the tiny presets' scale 30 is where clipping is active at all.
TASK_QK_CLIP_TAU = 30.0


def _option(default: Any = MISSING, help: str = "", *, choices=None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "flag": True})


def _need(where: str, cfg: Any, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {name}={getattr(cfg, name)!r}: expected {what}")


@dataclass
class OptimConfig:
    """K2's recipe: Muon with its update RMS matched to AdamW's, decoupled weight decay, QK-Clip."""

    optimizer: str = _option("muonclip", "muonclip | muon | adamw", choices=OPTIMIZERS)
    lr: float = _option(
        2e-2,
        "(peak) learning rate: Muon's, with RMS matched to AdamW, for muon/muonclip; AdamW's for --optimizer adamw",
    )
    # With muon/muonclip: the AdamW learning rate of embeddings, LM head and 1-D parameters.
    # (At scale K2 shares one lr thanks to Muon's RMS matching; at this tiny scale an embedding
    # table at Muon's lr of ~1e-2 makes the loss spike, so it gets its own.) 0 = same as lr.
    adamw_lr: float = _option(
        3e-3, "with muon/muonclip: AdamW lr of embeddings, head and 1-D params (0 = --lr)"
    )
    weight_decay: float = _option(0.1, "decoupled weight decay")
    tau: float = _option(
        TASK_QK_CLIP_TAU,
        "QK-Clip threshold (30: the paper's small-scale value; K2 used 100 at 1T scale, MuonClip's "
        "default); also drawn on the max-logit plot of non-clipping runs",
    )
    # Newton-Schulz compute dtype: "auto" = bf16 where bf16 GEMMs are native (CUDA, CPUs with
    # AMX / AVX512-BF16), fp32 where bf16 is emulated (AVX2 CPUs, where it is ~30x slower);
    # "fp32" makes updates stable across process layouts and resumes
    ns_dtype: str = _option(
        "auto",
        "Newton-Schulz dtype: auto (bf16 where bf16 GEMMs are native, else fp32), fp32, bf16",
        choices=NS_DTYPES,
    )
    grad_clip: float = _option(1.0, "gradient-norm clip (0 = off)")

    def validate(self, where: str) -> None:
        _need(where, self, "optimizer", self.optimizer in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}")
        _need(where, self, "lr", self.lr > 0, "> 0")
        _need(where, self, "adamw_lr", self.adamw_lr >= 0, ">= 0")
        _need(where, self, "tau", self.tau > 0, "> 0")
        _need(where, self, "ns_dtype", self.ns_dtype in NS_DTYPES, f"one of {', '.join(NS_DTYPES)}")


@dataclass
class WSDConfig:
    """Warmup, then constant, then a cosine decay over `decay_fraction` of the span, then held at
    `min_lr_ratio` (k2_optim.schedule)."""

    warmup_steps: int = _option(10, "WSD warmup steps")
    decay_fraction: float = _option(0.2, "WSD: fraction of the run spent in the cosine decay")
    schedule_steps: int = _option(
        0,
        "steps the WSD schedule spans (0: --steps); past its end the lr holds at min_lr_ratio x lr. "
        "Set when extending a finished run (--resume RUN --steps N) to say what the lr does",
    )
    min_lr_ratio: float = _option(0.1, "WSD: the final lr as a fraction of the peak")

    def span(self, steps: int) -> int:
        """The steps the schedule spans: `schedule_steps`, or the run's `steps`."""
        return self.schedule_steps or steps

    def phases(self, span: int) -> tuple[int, int, int]:
        """(warmup, stable, decay) steps of the schedule spanning `span` steps."""
        warmup = min(self.warmup_steps, span)
        decay = min(int(round(span * self.decay_fraction)), span - warmup)
        return warmup, span - warmup - decay, decay

    def lr_factors(self, span: int, steps: int) -> list[float]:
        """The lr multiplier of the first `steps` optimizer steps under a schedule spanning `span`."""
        phases = self.phases(span)
        return [wsd_factor(t, *phases, self.min_lr_ratio) for t in range(steps)]

    def validate(self, where: str) -> None:
        _need(where, self, "decay_fraction", 0 <= self.decay_fraction <= 1, "in [0, 1]")
        _need(where, self, "min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]")
        _need(where, self, "warmup_steps", self.warmup_steps >= 0, ">= 0")
        _need(where, self, "schedule_steps", self.schedule_steps >= 0, ">= 0 (0 = --steps)")


__all__ = ["NS_DTYPES", "OPTIMIZERS", "TASK_QK_CLIP_TAU", "OptimConfig", "WSDConfig"]
