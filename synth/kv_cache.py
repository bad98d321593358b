"""KV storage for T3. Two kinds, both read by every forward pass:

- `PrefixKV`: one voice's conditioning (per exaggeration), computed once and kept in the engine's prefix
  pool (keyed by the voice's content hash); admission copies the positions a row needs into the row's
  slot, so the decode step reads one contiguous key run per row. For CFG variants it also holds the
  unconditional row's text block,
  which is the same for every text of a given length (the reference zeroes the token embeddings and
  keeps only the learned text positions), so an unconditional row of text length L simply sees
  positions [0, cond_len + L) of it; it grows on demand up to the longest text seen.
- `SlotKVCache`: allocated once, one row per T3 sequence (a CFG segment owns two), holding the row's whole
  sequence: [prefix copy | text (cond row only) | BOS block | speech]; both rows of a CFG segment have the
  same length. Rows are claimed and released by the scheduler; the cache never grows.
  Position `max_len - 1` of every row is a scratch slot: decode steps write rows that are not in the
  batch there, and no real sequence may reach it, so a real row can never attend to it.
"""

from __future__ import annotations

import torch


class PrefixKV:
    """Per layer k, v: [H, length, D]. Positions [0, cond_len) are the conditioning; beyond that, the
    unconditional text block (CFG variants only)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values
        self.cond_len = self.length

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def extend(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Append positions (per layer [H, n, D]); the old tensors are replaced, never written in place."""
        self.keys = [torch.cat([old, new], dim=1) for old, new in zip(self.keys, keys, strict=True)]
        self.values = [torch.cat([old, new], dim=1) for old, new in zip(self.values, values, strict=True)]


class SlotKVCache:
    def __init__(self, *, n_layers: int, max_rows: int, n_heads: int, max_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (n_layers, max_rows, n_heads, max_len, head_dim)
        # all_keys, all_values: [layers, max_rows, H, max_len, D] (a step slices its bucket once for every layer);
        # keys[layer], values[layer]: [max_rows, H, max_len, D] views of them
        self.all_keys = torch.zeros(shape, device=device, dtype=dtype)
        self.all_values = torch.zeros(shape, device=device, dtype=dtype)
        self.keys = list(self.all_keys.unbind(0))
        self.values = list(self.all_values.unbind(0))
        self.max_rows = max_rows
        self.max_len = max_len
        self.scratch_pos = max_len - 1  # never part of a real sequence
        self.usable_len = max_len - 1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.all_keys, self.all_values))

    def install_prefix(self, row: int, prefix: PrefixKV, n_positions: int) -> None:
        """Copy prefix positions [0, n_positions) into positions [0, n_positions) of `row`, every layer."""
        for layer in range(len(self.keys)):
            self.keys[layer][row, :, :n_positions] = prefix.keys[layer][:, :n_positions]
            self.values[layer][row, :, :n_positions] = prefix.values[layer][:, :n_positions]

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write one position per entry. rows, positions: [N]; k, v: [N, H, D]."""
        self.keys[layer][rows, :, positions] = k
        self.values[layer][rows, :, positions] = v
