"""dtype names that cross process boundaries, and raw-byte views of tensors.

Everything on the wire is bytes: a tensor travels as a flat `uint8` view, which is also how
float8 gets through gloo (gloo's broadcast rejects float8 element types).
"""

from __future__ import annotations

import torch

_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
    )
    if hasattr(torch, name)
}
FLOAT8 = {d for n, d in _BY_NAME.items() if n.startswith("float8")}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"; raises for dtypes the engine does not carry."""
    name = str(dtype).removeprefix("torch.")
    if _BY_NAME.get(name) is not dtype:
        raise TypeError(f"dtype {dtype} is not supported by k2-ckpt (supported: {sorted(_BY_NAME)})")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise TypeError(f"unknown dtype name {name!r} (supported: {sorted(_BY_NAME)})") from None


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's storage (no copy)."""
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    return t.reshape(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """Inverse of `as_bytes`: view flat uint8 bytes as `dtype` with `shape` (no copy)."""
    return b.view(dtype).reshape(shape)


def nbytes_of(dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()
