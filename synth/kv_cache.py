"""A KV cache allocated once: one row per T3 sequence (a CFG segment owns two), written by index.

Rows are claimed and released by the scheduler; the cache never grows. Position `max_len - 1` of every
row is a scratch slot: decode steps write rows that are not in the batch there, and no real sequence
is ever allowed to reach it, so a real row can never attend to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """The cached conditioning prefix of one voice (and exaggeration): per layer k, v: [1, H, P, D]."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2])


class SlotKVCache:
    def __init__(self, *, n_layers: int, max_rows: int, n_heads: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (max_rows, n_heads, max_len, head_dim)
        # keys[layer], values[layer]: [max_rows, H, max_len, D]
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_rows = max_rows
        self.max_len = max_len
        self.scratch_pos = max_len - 1  # never part of a real sequence
        self.usable_len = max_len - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def load_prefix(self, rows: list[int], prefix: PrefixKV) -> None:
        """Copy a voice's conditioning KV into positions [0, P) of each row."""
        n_pos = prefix.length
        for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
            for row in rows:
                self.keys[layer][row, :, :n_pos] = k[0]
                self.values[layer][row, :, :n_pos] = v[0]

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write one new position per row. rows, positions: [R]; k, v: [R, H, 1, D]."""
        self.keys[layer][rows, :, positions] = k[:, :, 0]
        self.values[layer][rows, :, positions] = v[:, :, 0]

    def write_rows(self, layer: int, rows: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write S consecutive positions [start, start+S) of the given rows. rows: [R]; k, v: [R, H, S, D]."""
        n_new = k.shape[2]
        self.keys[layer][rows, :, start:start + n_new] = k
        self.values[layer][rows, :, start:start + n_new] = v
