"""INT4 routed experts in compressed-tensors' "pack-quantized" format, as K2-Thinking ships them.

Since K2-Thinking, Moonshot's K2-architecture checkpoints keep the routed experts in INT4 and the
rest in bf16. `config.json` declares it (`quantization_config`):

    quant_method "compressed-tensors", format "pack-quantized", one config group whose `weights`
    are {num_bits 4, type int, symmetric, strategy group, group_size 32}, targets ["Linear"],
    ignore: lm_head, attention, the shared experts and the dense MLP (regexes)

and each quantised Linear `X` is stored as three tensors instead of `X.weight`:

    X.weight_packed  int32 [out, in / 8]   eight 4-bit values per word, element i at bits 4 (i % 8)
                                            of word i // 8, stored unsigned (q + 8)
    X.weight_scale   bf16  [out, in / group_size]   one scale per group of `group_size` inputs
    X.weight_shape   int64 [2]              (out, in)

The weight is `q * scale`, computed in the scale's dtype (what compressed-tensors' decompress
returns; tested bitwise against the library). Quantising uses the library's rule for symmetric
groups: scale = max |w| / 7.5 over the group, q = clamp(round(w / scale), -8, 7).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "INT4_SUFFIXES",
    "Int4Format",
    "dequantize_int4",
    "fake_quantize_int4",
    "k2_thinking_quantization_config",
    "pack_int4",
    "parse_quantization_config",
    "quantize_int4",
    "unpack_int4",
]

INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
BITS = 4
Q_MIN, Q_MAX = -(1 << (BITS - 1)), (1 << (BITS - 1)) - 1  # -8, 7
PER_WORD = 32 // BITS  # 8 values per int32

# K2-Thinking's quantization_config (as its config.json declares it): only routed experts are INT4.
K2_THINKING_IGNORE = (
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)


@dataclass(frozen=True)
class Int4Format:
    """What k2 reads and writes: symmetric INT4 groups along the input dimension."""

    group_size: int = 32
    ignore: tuple[str, ...] = K2_THINKING_IGNORE

    def quantizes(self, name: str) -> bool:
        """Whether the Linear weight `name` (an HF tensor name ending in `.weight`) is INT4 here:
        not matched by `ignore` (plain names match the module name, `re:` patterns as regexes)."""
        module = name.removesuffix(".weight")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith("." + pattern):
                return False
        return True


def k2_thinking_quantization_config(fmt: Int4Format = Int4Format()) -> dict[str, Any]:
    """The `quantization_config` K2-Thinking's config.json carries, for `fmt`."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": BITS,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": fmt.group_size,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(fmt.ignore),
        "kv_cache_scheme": None,
    }


def parse_quantization_config(qc: dict[str, Any] | None, where: str = "config.json") -> Int4Format | None:
    """The INT4 format a compressed-tensors `quantization_config` declares, None for no or another
    quantization method (FP8 is read elsewhere); ValueError naming the field and value for a
    compressed-tensors config k2 does not read."""
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return None

    def refuse(field: str, value: Any, want: str) -> ValueError:
        return ValueError(
            f"{where}: quantization_config.{field} = {value!r} is not supported "
            f"(k2 reads compressed-tensors {want})"
        )

    if qc.get("format") != "pack-quantized":
        raise refuse("format", qc.get("format"), "'pack-quantized'")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse("config_groups", sorted(groups), "with exactly one config group")
    ((gname, group),) = groups.items()
    w = group.get("weights") or {}
    for key, want in (("num_bits", BITS), ("type", "int"), ("symmetric", True), ("strategy", "group")):
        if w.get(key) != want:
            raise refuse(f"config_groups.{gname}.weights.{key}", w.get(key), f"{key} {want!r}")
    if w.get("dynamic") not in (False, None):
        raise refuse(f"config_groups.{gname}.weights.dynamic", w.get("dynamic"), "static weights")
    if w.get("actorder") not in (None, False):
        raise refuse(f"config_groups.{gname}.weights.actorder", w.get("actorder"), "without activation order")
    gs = w.get("group_size")
    if not isinstance(gs, int) or gs <= 0 or gs % PER_WORD:
        raise refuse(f"config_groups.{gname}.weights.group_size", gs, f"a positive multiple of {PER_WORD}")
    for act in ("input_activations", "output_activations"):
        if group.get(act):
            raise refuse(f"config_groups.{gname}.{act}", group.get(act), "weight-only quantization")
    if group.get("targets") not in (["Linear"], None):
        raise refuse(f"config_groups.{gname}.targets", group.get("targets"), "targets ['Linear']")
    return Int4Format(group_size=gs, ignore=tuple(qc.get("ignore") or ()))


def unpack_int4(packed: Tensor, shape: tuple[int, int]) -> Tensor:
    """int8 [out, in] values in [-8, 7] from int32 [out, ceil(in / 8)] words."""
    out, inp = shape
    if packed.dtype != torch.int32 or tuple(packed.shape) != (out, math.ceil(inp / PER_WORD)):
        raise ValueError(
            f"weight_packed is {packed.dtype} {tuple(packed.shape)}; for weight_shape {shape} expected "
            f"int32 {(out, math.ceil(inp / PER_WORD))}"
        )
    shifts = torch.arange(PER_WORD, dtype=torch.int32, device=packed.device) * BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then the low 4 bits
    return (nibbles.reshape(out, -1)[:, :inp] + Q_MIN).to(torch.int8)


def pack_int4(q: Tensor) -> Tensor:
    """int32 [out, ceil(in / 8)] words from int8 [out, in] values in [-8, 7] (unpack_int4's inverse)."""
    out, inp = q.shape
    words = math.ceil(inp / PER_WORD)
    u = (q.to(torch.int32) - Q_MIN).reshape(out, -1)
    u = torch.nn.functional.pad(u, (0, words * PER_WORD - inp)).reshape(out, words, PER_WORD)
    shifts = torch.arange(PER_WORD, dtype=torch.int64, device=q.device) * BITS
    # the nibbles' bits do not overlap, so their sum is their OR; summed in int64, wrapped to int32
    total = (u.to(torch.int64) << shifts).sum(-1)
    return torch.where(total >= (1 << 31), total - (1 << 32), total).to(torch.int32)


def _check_groups(shape: tuple[int, int], scale: Tensor, group_size: int, what: str) -> None:
    out, inp = shape
    if tuple(scale.shape) != (out, math.ceil(inp / group_size)):
        raise ValueError(
            f"{what}: weight_scale {tuple(scale.shape)} does not match weight_shape {shape} with "
            f"groups of {group_size} (expected {(out, math.ceil(inp / group_size))})"
        )


def dequantize_int4(
    packed: Tensor, scale: Tensor, shape: tuple[int, int], group_size: int, what: str = "tensor"
) -> Tensor:
    """`q * scale` in the scale's dtype, [out, in] (what compressed-tensors' decompress returns)."""
    shape = (int(shape[0]), int(shape[1]))
    _check_groups(shape, scale, group_size, what)
    q = unpack_int4(packed, shape)
    out, inp = shape
    groups = scale.shape[1]
    qg = torch.nn.functional.pad(q.to(scale.dtype), (0, groups * group_size - inp)).reshape(
        out, groups, group_size
    )
    return (qg * scale.unsqueeze(-1)).reshape(out, -1)[:, :inp]


def quantize_int4(
    w: Tensor, group_size: int = 32, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[Tensor, Tensor, Tensor]:
    """(weight_packed, weight_scale, weight_shape) of `w` [out, in]: symmetric groups, scale
    max |w| / 7.5 (compressed-tensors' rule; a zero group gets scale 1), q = clamp(round(w / scale))."""
    out, inp = w.shape
    groups = math.ceil(inp / group_size)
    x = w.to(scale_dtype)
    xg = torch.nn.functional.pad(x, (0, groups * group_size - inp)).reshape(out, groups, group_size)
    amax = xg.abs().amax(-1)
    scale = amax / torch.tensor((Q_MAX - Q_MIN) / 2, dtype=scale_dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(xg / scale.unsqueeze(-1)), Q_MIN, Q_MAX).reshape(out, -1)[:, :inp]
    return pack_int4(q.to(torch.int8)), scale, torch.tensor([out, inp], dtype=torch.int64)


def fake_quantize_int(w: Tensor, bits: int, group_size: int = 32) -> Tensor:
    """`fake_quantize_int4`'s rule at another width: symmetric groups, bf16 scale max |w| / (2^(bits-1)
    - 0.5), levels [-2^(bits-1), 2^(bits-1) - 1], straight-through gradient. bits=4 is exactly
    `fake_quantize_int4`; 3 and 2 are coarser schemes with no export format (for studies of what
    quantisation costs and what QAT recovers, where INT4 costs too little to measure)."""
    if bits == 4:
        return fake_quantize_int4(w, group_size)
    if not 2 <= bits <= 8:
        raise ValueError(f"fake_quantize_int: bits must be in [2, 8], got {bits}")
    *lead, inp = w.shape
    if inp % group_size:
        raise ValueError(f"fake_quantize_int: input dim {inp} is not a multiple of group_size {group_size}")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    with torch.no_grad():
        x = w.detach().to(torch.bfloat16).reshape(*lead, inp // group_size, group_size)
        scale = x.abs().amax(-1, keepdim=True) / torch.tensor((hi - lo) / 2, dtype=torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        fq = (torch.clamp(torch.round(x / scale), lo, hi) * scale).reshape(w.shape).to(w.dtype)
    return w + (fq - w).detach()


def fake_quantize_int4(w: Tensor, group_size: int = 32) -> Tensor:
    """INT4 quantisation-aware training's weight: the value an INT4 export of `w` loads back to
    (`quantize_int4` then `dequantize_int4`: scales in bf16 per group of `group_size` along the
    last, input, dimension; any leading dims, e.g. stacked experts [E, O, I]), in `w`'s dtype, with
    a straight-through gradient (d out / d w = 1), so the optimizer keeps full-precision weights."""
    *lead, inp = w.shape
    if inp % group_size:
        raise ValueError(f"fake_quantize_int4: input dim {inp} is not a multiple of group_size {group_size}")
    with torch.no_grad():
        x = w.detach().to(torch.bfloat16).reshape(*lead, inp // group_size, group_size)
        scale = x.abs().amax(-1, keepdim=True) / torch.tensor((Q_MAX - Q_MIN) / 2, dtype=torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.clamp(torch.round(x / scale), Q_MIN, Q_MAX)
        fq = (q * scale).reshape(w.shape).to(w.dtype)
    return w + (fq - w).detach()
