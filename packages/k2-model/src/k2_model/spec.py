"""`ModelSpec`: which model a run trains (a preset with overrides, or weights to start from) and
its attention path, as a config component that task configs (k2-train, k2-rl) nest.

Fields carry their help text in dataclass metadata (`help`, optional `choices`), the form the
`k2` command generates its flags from; k2-model sits below k2-train, so it writes that metadata
itself rather than importing k2-train's `option`."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any

ATTENTIONS = ("auto", "fused", "sdpa", "eager")
QAT_SCHEMES = ("none", "int4", "int3", "int2")


def _option(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, choices=None) -> Any:
    metadata = {"help": help, "choices": choices, "flag": True}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelSpec:
    preset: str = _option(
        "tiny",
        "model preset (tiny, tiny-vllm, kimi-k2, deepseek-v3); with --init the weights' own architecture is used",
    )
    model_overrides: dict[str, Any] = _option(
        default_factory=dict,
        help="K2Config fields over the preset, as JSON (e.g. '{\"n_routed_experts\": 64}')",
    )
    # Start from these weights: an HF-format dir (`k2 export`, from_pretrained) or a k2 run dir
    # (its latest train state); None = a random init of `preset`.
    init: str | None = _option(
        None,
        "start from these weights: an HF-format dir (`k2 export`) or a k2 run dir, e.g. an SFT run "
        "(None: random init of --preset)",
    )
    # "auto": k2_kernels' fused attention (max logits from the kernel, no score matrix) where a
    # compiled kernel serves the device, else SDPA/eager; or force "fused", "sdpa", "eager".
    attention: str = _option(
        "auto",
        "attention path: auto (the fused k2_kernels kernel where it serves the device), fused, sdpa or eager",
        choices=ATTENTIONS,
    )
    # INT4 quantisation-aware training of the routed experts (K2-Thinking's recipe): the forward
    # sees the weights an INT4 export loads, the optimizer keeps full precision (k2_model.int4)
    qat: str = _option(
        "none",
        "quantisation-aware training: int4 (routed experts fake-quantised to INT4, groups of 32, "
        "straight-through gradients; export with `k2 export --quantize int4`), int3 / int2 (the same "
        "rule at 3 or 2 bits, for quantisation studies; no export format) or none",
        choices=QAT_SCHEMES,
    )

    def validate(self, where: str) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"{where}: attention={self.attention!r}: expected auto, fused, sdpa or eager")
        if self.qat not in QAT_SCHEMES:
            raise ValueError(f"{where}: qat={self.qat!r}: expected none, int4, int3 or int2")

    @property
    def qat_group_size(self) -> int:
        """The group size QAT uses (0: off)."""
        return 0 if self.qat == "none" else 32

    @property
    def qat_bits(self) -> int:
        """The bit width QAT rounds the routed experts to (4 for int4)."""
        return int(self.qat.removeprefix("int")) if self.qat != "none" else 4


__all__ = ["ATTENTIONS", "ModelSpec", "QAT_SCHEMES"]
