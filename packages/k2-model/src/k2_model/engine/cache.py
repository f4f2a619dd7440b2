"""The MLA compressed KV cache: per token and layer, the normalised latent and the rotated rotary key.

Shape legend: Ly layers, N slots (one per running sequence), L token capacity per slot,
C kv_lora_rank, R qk_rope_head_dim, K = C + R (one cache row), n running sequences.

A row is `[kv_a_layernorm(c) (C), rope(k_rope) (R)]`: everything MLA's attention needs, since
every head's key-nope and value are linear in the latent (`kv_b_proj`). That is C + R values per
token and layer (576 for K2) instead of H * (P + R + V) for expanded per-head keys and values
(20,480 for K2's 64 heads): 35.6x smaller.

Slots are kept dense: running sequences occupy slots 0..n-1, so a decode step reads the view
`kv[layer, :n, :length]` with no gather. When a sequence leaves, the last running sequence is
moved into its slot (one sequence's rows are copied). Capacity (slots and tokens) grows by
doubling, so memory follows the longest running sequence rather than the model's maximum length.
"""

from __future__ import annotations

import torch
from torch import Tensor


class MLACache:
    """Per-layer `[slots, capacity, C + R]` storage for running sequences."""

    def __init__(
        self,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_slots: int = 64,
        max_len: int = 4096,
        initial_slots: int = 4,
        initial_len: int = 256,
    ) -> None:
        if max_slots <= 0 or max_len <= 0:
            raise ValueError(f"MLACache: max_slots and max_len must be positive, got {max_slots}, {max_len}")
        self.num_layers, self.C, self.R = num_layers, kv_lora_rank, rope_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_slots, self.max_len = max_slots, max_len
        self.kv_LyNLK = torch.zeros(
            num_layers, min(initial_slots, max_slots), min(initial_len, max_len), self.row_size,
            dtype=dtype, device=self.device,
        )  # fmt: skip

    @property
    def row_size(self) -> int:
        return self.C + self.R

    @property
    def slots(self) -> int:
        return self.kv_LyNLK.shape[1]

    @property
    def capacity(self) -> int:
        return self.kv_LyNLK.shape[2]

    def bytes_per_token(self) -> int:
        """(kv_lora_rank + qk_rope_head_dim) * layers * dtype bytes."""
        return self.row_size * self.num_layers * self.kv_LyNLK.element_size()

    def allocated_bytes(self) -> int:
        return self.kv_LyNLK.numel() * self.kv_LyNLK.element_size()

    def ensure(self, slots: int, length: int) -> None:
        """Grow (by doubling) so that `slots` slots of `length` tokens fit; keeps the contents."""
        if slots > self.max_slots:
            raise ValueError(f"MLACache: {slots} slots requested, max_slots is {self.max_slots}")
        if length > self.max_len:
            raise ValueError(f"MLACache: {length} tokens requested, max_len is {self.max_len}")
        new_n, new_l = self.slots, self.capacity
        while new_n < slots:
            new_n = min(2 * new_n, self.max_slots)
        while new_l < length:
            new_l = min(2 * new_l, self.max_len)
        if (new_n, new_l) == (self.slots, self.capacity):
            return
        grown = torch.zeros(
            self.num_layers, new_n, new_l, self.row_size, dtype=self.dtype, device=self.device
        )
        grown[:, : self.slots, : self.capacity] = self.kv_LyNLK
        self.kv_LyNLK = grown

    def write(self, layer: int, slot_n: Tensor, pos_n: Tensor, row_nK: Tensor) -> None:
        """Store one row per (slot, position) pair (a decode step)."""
        self.kv_LyNLK[layer, slot_n, pos_n] = row_nK.to(self.dtype)

    def write_span(self, layer: int, slot: int, start: int, rows_SK: Tensor) -> None:
        """Store consecutive rows of one sequence (a prefill)."""
        self.kv_LyNLK[layer, slot, start : start + rows_SK.shape[0]] = rows_SK.to(self.dtype)

    def view(self, layer: int, n: int, length: int) -> Tensor:
        """Slots 0..n-1, tokens 0..length-1 of one layer: `[n, length, C + R]` (a view, no copy)."""
        return self.kv_LyNLK[layer, :n, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` rows of slot `src` into slot `dst` in every layer (compaction)."""
        if src != dst and length > 0:
            self.kv_LyNLK[:, dst, :length] = self.kv_LyNLK[:, src, :length]
