"""T3's decode-step attention on the CPU, reading each voice's prefix once (`decode_attention.c`).

Every cache row holds a copy of its voice's conditioning prefix (Turbo: 376 positions, 74 MB per row and step in
fp32), so the torch attention reads that copy once per row: with 8 segments on one voice, 8 copies, and each row
also reads the padding up to the step's key bucket. This kernel reads a row's first `shared` positions from the
voice's `PrefixKV` (one tensor per voice and layer, the same values the row's copy holds), the rest of its keys
from the row, and nothing past the row's own length. Each (row, head) is one sequential computation, so a row's
output does not depend on its batch, the key bucket or the thread count (bitwise), which the engine needs for a
seeded segment's tokens (tests/synth/test_decode_attention.py).

float32, CPU only; `available()` says whether it compiled here (else the runner keeps the torch attention).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from synth import ckernel

SOURCE = Path(__file__).with_name("decode_attention.c")


# No FMA contraction: with it, a row's bits changed with its batch (tests/synth/test_t3_runner.py, measured): a
# vectorised loop's body and its scalar remainder may contract differently, and which keys fall in which is not the
# row's alone. Without it every operation rounds as written, wherever it runs.
FLAGS = (*(flag for flag in ckernel.OPENMP_CFLAGS if not flag.startswith("-ffp-contract")), "-ffp-contract=off")
PORTABLE_FLAG = "-DDECODE_ATTENTION_MEMORY_TREE"  # the lane tree through memory, as compilers without vector shuffles


@functools.cache
def _library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    lib = ckernel.build(SOURCE, flags, purpose="the CPU decode attention")
    fn = lib.decode_attention_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                   ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return lib


MAX_HEAD_DIM = 256  # MAX_DIM in the C source


def supports(head_dim: int) -> bool:
    """Head sizes the kernel takes: multiples of 16 (its vector width) up to MAX_HEAD_DIM (T3's is 64)."""
    return head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM


def available() -> bool:
    try:
        _library()
    except ckernel.KernelUnavailable:
        return False
    return True


class RowPrefixes:
    """Per row: where its shared prefix lives for each layer (addresses of the voice's key and value tensors
    [H, length, D]), their head stride, and how many of the row's positions it covers. Rows without one read
    everything from their own cache (`shared` 0). Holds the tensors it points at."""

    def __init__(self, max_rows: int, n_layers: int) -> None:
        self.keys = np.zeros((n_layers, max_rows), dtype=np.int64)
        self.values = np.zeros((n_layers, max_rows), dtype=np.int64)
        self.head_stride = np.zeros(max_rows, dtype=np.int64)
        self.shared = np.zeros(max_rows, dtype=np.int64)
        self._held: list[tuple[list[torch.Tensor], list[torch.Tensor]] | None] = [None] * max_rows

    def set(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor], shared: int) -> None:
        """Row `row` now starts with positions [0, shared) of these per-layer [H, length, D] tensors."""
        if shared > keys[0].shape[1]:
            raise ValueError("a row cannot share more positions than its prefix has")
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if not (k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32):
                raise ValueError("prefix tensors must be contiguous float32")
            self.keys[layer, row], self.values[layer, row] = k.data_ptr(), v.data_ptr()
        self.head_stride[row] = keys[0].stride(0)
        self.shared[row] = shared
        self._held[row] = (list(keys), list(values))

    def holding(self) -> list[int]:
        """Rows that hold a prefix (each keeps its voice's tensors alive)."""
        return [row for row, held in enumerate(self._held) if held is not None]

    def clear(self, row: int) -> None:
        self.shared[row] = 0
        self.keys[:, row] = self.values[:, row] = 0
        self._held[row] = None


def attention(q: torch.Tensor, cache_keys: torch.Tensor, cache_values: torch.Tensor, prefixes: RowPrefixes,
              layer: int, visible: torch.Tensor, n_keys: int, scale: float,
              row_ids: npt.NDArray[np.int64] | None = None) -> torch.Tensor:
    """q [R, H, 1, D] over each row's keys [0, visible[r]) (at most n_keys): positions below the row's `shared`
    from its prefix, the others from cache_keys / cache_values [max_rows, H, max_len, D] (contiguous). q's row r is
    cache row row_ids[r] (default: r). Returns [R, H, 1, D]."""
    rows, heads, _, dim = q.shape
    cache_rows = min(cache_keys.shape[0], prefixes.shared.shape[0])
    if row_ids is None:
        if rows > cache_rows:
            raise ValueError("more rows than the cache has")
        row_ids = _identity(rows)
    elif row_ids.shape != (rows,) or row_ids.dtype != np.int64 or not row_ids.flags.c_contiguous:
        raise ValueError("row_ids must be a contiguous int64 array with one cache row per row of q")
    elif rows and (int(row_ids.min()) < 0 or int(row_ids.max()) >= cache_rows):
        raise ValueError("a row id is outside the cache")
    if not supports(dim):
        raise ValueError(f"head_dim must be a multiple of 16, at most {MAX_HEAD_DIM}")
    if not (cache_keys.is_contiguous() and cache_values.is_contiguous()):
        raise ValueError("the cache must be contiguous")
    q = q.contiguous()
    visible = visible[:rows].contiguous()
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    scratch = torch.empty(threads * n_keys, dtype=torch.float32)
    _library().decode_attention_f32(
        rows, row_ids.ctypes.data, heads, dim, scale, q.data_ptr(), out.data_ptr(), cache_keys.data_ptr(),
        cache_values.data_ptr(),
        cache_keys.stride(0), cache_keys.stride(1), prefixes.keys[layer].ctypes.data,
        prefixes.values[layer].ctypes.data, prefixes.head_stride.ctypes.data, prefixes.shared.ctypes.data,
        visible.data_ptr(), n_keys, scratch.data_ptr(), threads)
    return out


@functools.cache
def _identity(rows: int) -> npt.NDArray[np.int64]:
    """Cache rows 0 .. rows - 1 (a step over the rows [0, rows) of a bucket)."""
    ids = np.arange(rows, dtype=np.int64)
    ids.flags.writeable = False
    return ids
