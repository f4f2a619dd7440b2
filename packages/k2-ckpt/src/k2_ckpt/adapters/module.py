"""`ModuleAdapter`: load pushed tensors into any `nn.Module` by parameter/buffer name.

Built for `K2ForCausalLM`-style models with DeepseekV3 (HF) names, but needs nothing from
k2-model: it is a `load_state_dict`-like in-place copy, strict about dtype and shape, with
one conversion: an FP8 `X.weight` with its block scale `X.weight_scale_inv` (128x128 blocks,
as in the released K2/V3 checkpoints) is dequantised into a higher-precision `X.weight`. An
engine that itself holds `X.weight_scale_inv` (an FP8 engine) gets both tensors as they are.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from k2_ckpt.dtypes import FLOAT8
from k2_ckpt.errors import TensorMismatch

SCALE_SUFFIX = "_scale_inv"

# module -> names of its tensors that an assign commit swapped in (their storage may be a
# transfer buffer). Kept per module, not per adapter: a new adapter for every update is common.
_SWAPPED: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def dequantize_fp8_blocks(
    w_OI: torch.Tensor, scale_inv_oi: torch.Tensor, block: int = 128, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w * scale per (block x block) tile: `scale_inv_oi` is [ceil(O/block), ceil(I/block)]."""
    O, I = w_OI.shape
    s_OI = scale_inv_oi.float().repeat_interleave(block, 0)[:O].repeat_interleave(block, 1)[:, :I]
    return (w_OI.float() * s_OI).to(out_dtype)


class ModuleAdapter:
    """A `WeightLoader` over `module`'s parameters and persistent buffers.

    `name_map` renames incoming names first (return None to skip a tensor); unknown names
    raise `TensorMismatch` unless `ignore_unknown`. With `assign=True` a staged commit swaps
    the staged tensors in (like `load_state_dict(assign=True)`) instead of copying them, and
    the old storages become the next update's staging buffers: the commit costs no copy, but
    code holding views of the old tensors keeps seeing old data (do not use it under CUDA graphs).
    Swapped-in tensors may be views of the server's transfer buffer, which stays reserved only
    for the latest update's tensors: after every staged commit, a tensor swapped in earlier that
    this commit did not swap in again is given private memory (a copy).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        name_map: Callable[[str], str | None] | None = None,
        ignore_unknown: bool = False,
        fp8_block: int = 128,
        assign: bool = False,
    ):
        self.module = module
        self.assign = assign
        self.targets: dict[str, torch.Tensor] = dict(module.named_parameters())
        self.targets.update(module.state_dict(keep_vars=True))  # persistent buffers too
        self.name_map, self.ignore_unknown, self.block = name_map, ignore_unknown, fp8_block
        self._pending_fp8: dict[str, torch.Tensor] = {}  # weight name -> fp8 data awaiting its scale
        self._pending_scale: dict[str, torch.Tensor] = {}
        # receiver staging buffers, reused across updates (staged mode keeps one model-sized copy):
        # name -> a contiguous tensor whose bytes the next update may stage into
        self.staging_pool: dict[str, torch.Tensor] = {}
        self._valid: set[tuple] = (
            set()
        )  # (name, dtype, shape) that passed `validate`: every update repeats them
        self._swapped_now: set[str] = set()  # targets the current update's commit swapped in
        self._committed_now = False  # the current update had a staged commit

    def _name(self, name: str) -> str | None:
        return self.name_map(name) if self.name_map is not None else name

    def _is_dequant_scale(self, mapped: str) -> bool:
        """A block scale to fold into its weight: only when the engine has no tensor of that name."""
        return mapped.endswith(SCALE_SUFFIX) and mapped not in self.targets

    def _target(self, name: str, orig: str) -> torch.Tensor | None:
        t = self.targets.get(name)
        if t is None and not self.ignore_unknown:
            raise TensorMismatch(
                f"tensor {orig!r}: the receiver's module has no parameter or buffer {name!r}"
            )
        return t

    def validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        key = (name, dtype, tuple(shape))
        if key not in self._valid:  # the targets never change, so neither does the answer
            self._validate(name, dtype, shape)
            self._valid.add(key)

    def _validate(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        mapped = self._name(name)
        if mapped is None:
            return
        if self._is_dequant_scale(mapped):  # block scale of an FP8 weight the engine dequantises
            weight = self._target(mapped[: -len(SCALE_SUFFIX)], name)
            if weight is None:
                return
            want = tuple(math.ceil(s / self.block) for s in weight.shape)
            if tuple(shape) != want:
                raise TensorMismatch(
                    f"tensor {name!r}: block scale shape {tuple(shape)}, expected {want} "
                    f"for weight shape {tuple(weight.shape)} with {self.block}x{self.block} blocks"
                )
            return
        t = self._target(mapped, name)
        if t is None:
            return
        if tuple(shape) != tuple(t.shape):
            raise TensorMismatch(f"tensor {name!r}: shape {tuple(shape)} sent, receiver has {tuple(t.shape)}")
        dequant = dtype in FLOAT8 and t.dtype not in FLOAT8 and t.dim() == 2
        if dtype != t.dtype and not dequant:
            raise TensorMismatch(f"tensor {name!r}: dtype {dtype} sent, receiver has {t.dtype}")

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, src in named:
            mapped = self._name(name)
            if mapped is None:
                continue
            if self._is_dequant_scale(mapped):
                wname = mapped[: -len(SCALE_SUFFIX)]
                if wname in self._pending_fp8:
                    self._copy_dequant(wname, self._pending_fp8.pop(wname), src)
                else:
                    self._pending_scale[wname] = src.clone()
                continue
            dst = self.targets.get(mapped)
            if dst is None:
                continue  # ignore_unknown
            if src.dtype in FLOAT8 and dst.dtype not in FLOAT8:
                if mapped in self._pending_scale:
                    self._copy_dequant(mapped, src, self._pending_scale.pop(mapped))
                else:
                    self._pending_fp8[mapped] = src.clone()
                continue
            if src.dtype != dst.dtype or src.shape != dst.shape:
                raise TensorMismatch(
                    f"tensor {name!r}: {src.dtype}{tuple(src.shape)} does not match the "
                    f"receiver's {dst.dtype}{tuple(dst.shape)}"
                )
            if src.dtype in FLOAT8:  # byte copy: not every device/kernel copies float8 directly
                dst.view(torch.uint8).copy_(src.view(torch.uint8))
            else:
                dst.copy_(src)

    @torch.no_grad()
    def commit_staged(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Apply tensors that the receiver staged in `staging_pool` buffers (staged mode only)."""
        self._committed_now = True
        if not self.assign:
            self.load_weights(named)
            return
        rest = []
        for name, src in named:
            mapped = self._name(name)
            dst = self.targets.get(mapped) if mapped is not None else None
            if (
                dst is None
                or src.dtype != dst.dtype
                or src.shape != dst.shape
                or src.device != dst.device
                or not dst.is_contiguous()
            ):
                rest.append((name, src))  # dequantised, renamed-away or other-device tensors: the copy path
                continue
            self.staging_pool[name] = dst.data  # the next update stages into the old storage
            dst.data = src
            self._swapped_now.add(mapped)
        self.load_weights(rest)

    def abort(self) -> None:
        """The update was abandoned: forget FP8 halves waiting for their partner."""
        self._pending_fp8.clear()
        self._pending_scale.clear()
        _SWAPPED.setdefault(self.module, set()).update(
            self._swapped_now
        )  # a failed commit may have swapped some in
        self._swapped_now, self._committed_now = set(), False

    def _copy_dequant(self, name: str, w: torch.Tensor, scale: torch.Tensor) -> None:
        dst = self.targets[name]
        dst.copy_(dequantize_fp8_blocks(w, scale.to(w.device), self.block, out_dtype=dst.dtype))

    @torch.no_grad()
    def post_load(self) -> None:
        if self._committed_now:
            # after a staged commit the server protects only this update's buffer: tensors an
            # earlier commit swapped in and this one did not may view a buffer it now reuses
            earlier = _SWAPPED.get(self.module, set())
            for name in earlier - self._swapped_now:
                t = self.targets[name]
                t.data = t.data.clone()
            _SWAPPED[self.module] = self._swapped_now
            self._swapped_now, self._committed_now = set(), False
        missing = sorted(set(self._pending_fp8) | set(self._pending_scale))
        self._pending_fp8.clear()
        self._pending_scale.clear()
        if missing:
            raise TensorMismatch(
                f"FP8 weights without their {SCALE_SUFFIX} partner (or the reverse): {missing}"
            )
