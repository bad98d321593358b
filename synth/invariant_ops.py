"""Linear and convolution kernels for batched S3Gen renders, whose result for one row does not depend on the rows
it is batched with.

Why: a seeded stream must give the same PCM whatever it is batched with (docs/protocol.md promises it), and
which streams share a vocoder tick depends on timing. On the CPU, torch's default kernels do not keep a row's
bits when the batch changes (measured on the development machine, torch 2.13: `F.linear` (MKL) changes them
with the number of rows, oneDNN's direct convolution between one image and several, oneDNN's prepacked linear
for large inner sizes). What does keep them is one GEMM per row of the batch, all of the same shape:
`torch.baddbmm` with the weight expanded over the batch (stride 0), which MKL runs as a batch of identical
GEMMs, once each product has at least 4 rows and a multiple of 16 columns (smaller ones are padded: below
that MKL's batched GEMM, too, changed a row's bits for some shapes; tests/synth/test_invariant_ops.py checks
the shape classes S3Gen meets: odd and small column counts, 1-3 rows). So on the CPU:

- a linear layer is one `baddbmm` over [B, T, in] (the same T for every row of a bucket);
- a convolution is the sum of one `baddbmm` per kernel tap over shifted views of channels-last activations
  [B, T, C] (no im2col copy: the views are strided, not copied); 1.1-1.6x oneDNN's direct convolution on HiFT's
  shapes, measured on the 2-core development machine;
- a transposed convolution is one `baddbmm` to [B, T, k * out] and an overlap-add of the k taps (F.fold).

A render nobody needs to reproduce (no client seed) may run the library's kernels on the CPU too, inside
`library_kernels()` (this thread only): oneDNN's convolutions and MKL's GEMMs without the padding, 2-3x faster on
a lone stream's render (BENCHMARKS.md, issue 15), with bits that depend on the batch.

On CUDA the same classes call cuBLAS/cuDNN (`F.linear`, `F.conv1d`, `F.conv_transpose1d`): fastest, and what
`torch.compile` / CUDA graphs capture; a row's last bits may then depend on its batch (see BENCHMARKS.md).

With `Kernels.gemm_dtype` bfloat16 (the CPU, `--cpu-vocoder bf16`), each product runs on bfloat16 inputs and
weights (the weights rounded once) and comes back as float32, which is what everything between the products
stays in; a convolution is then one product over its unfolded taps (a copy of k shifted views), not a sum of
one product per tap, so its rounding happens once. oneDNN's bf16 GEMMs run 3-4x MKL's fp32 ones on an AVX512-BF16
CPU (BENCHMARKS.md, issue 15), 5-10x on one with AMX (Intel Xeon, 4th generation up), and keep a row's bits whatever
the batch under the same padding rules (tests/synth/test_invariant_ops.py) when they run on one OpenMP thread. On two
threads oneDNN's AMX kernels split some products' sums between the threads (few rows, long sums: [8, 3072] @
[3072, 256]; a tiny English model's convolution, [37, 2048] @ [2048, 512] in a batch of 3), which changes a row's
last bits with the batch and the thread count; so a lowered product runs on one thread whatever the caller's count
(`_one_thread_bmm`).

Every layer is read once from the library's module (weight-norm parametrisations resolved), so the library's
modules stay untouched and chatterbox's own inference keeps running them as shipped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# MKL's batched GEMM kept a row's bits whatever the batch for every shape tried with at least 4 rows per
# matrix and a column count that is a multiple of 16, not always otherwise (1 row with 257 columns, 19 rows with
# 6, 7 or 9 columns: measured, tests/synth/test_invariant_ops.py), so products are padded up to such shapes
# (zero rows and columns) and cut back.
MIN_GEMM_ROWS = 4
GEMM_COLUMN_MULTIPLE = 16
# A batch of one is not always run as a batch: on an AMD EPYC (AVX-512, MKL 2024.2, torch 2.13) a one-matrix
# `bmm`/`baddbmm` gave other bits than the same matrix in a batch of 2 or more (the Intel machine these kernels
# were first measured on did not). So a lone matrix is run with a zero companion and cut back: the product costs
# twice as much for a stream rendered alone, and its bits are the ones it gets in any batch.
MIN_GEMM_BATCH = 2


_kernels = threading.local()  # .library: this thread runs the library's kernels in ops built row-invariant


@contextmanager
def library_kernels(enabled: bool = True) -> Iterator[None]:
    """Within the block, on this thread, ops built row-invariant run the library's kernels instead (when
    `enabled`): for work whose bits need not be reproducible. Nests; restores the previous choice on exit."""
    previous = getattr(_kernels, "library", False)
    _kernels.library = enabled
    try:
        yield
    finally:
        _kernels.library = previous


def _invariant_now(built_invariant: bool) -> bool:
    return built_invariant and not getattr(_kernels, "library", False)


def _batched(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`op(x)` (a batched GEMM over x's first dim) with at least MIN_GEMM_BATCH matrices in the batch."""
    batch = x.shape[0]  # the same ops whatever the batch (a zero-width pad when it is big enough)
    return op(F.pad(x, (0, 0, 0, 0, 0, max(0, MIN_GEMM_BATCH - batch))))[:batch]


def _one_thread_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)` on this thread alone (a lowered product: see the module's docstring). Only a lent render
    runs on more than one thread. Setting the count costs well under a microsecond and keeps the thread's OpenMP
    team; it also sets torch's process-wide default, which only a thread's first parallel op reads
    (`synth.cpu_threads.use_threads` runs that op before setting its own count)."""
    threads = torch.get_num_threads()
    if threads == 1:
        return torch.bmm(a, b)
    torch.set_num_threads(1)
    try:
        return torch.bmm(a, b)
    finally:
        torch.set_num_threads(threads)


def _gemm_columns(columns: int) -> int:
    return -(-columns // GEMM_COLUMN_MULTIPLE) * GEMM_COLUMN_MULTIPLE


def row_invariant_default(device: torch.device) -> bool:
    """CPU: the batch-invariant kernels; CUDA: cuBLAS/cuDNN."""
    return device.type != "cuda"


@dataclass(frozen=True, slots=True)
class Kernels:
    """How a layer's products run: row-invariant (CPU) or the library's, and in which dtype (float32, or bfloat16
    products with float32 results)."""

    invariant: bool
    gemm_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.gemm_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"gemm_dtype must be float32 or bfloat16, not {self.gemm_dtype}")

    @property
    def lowered(self) -> bool:
        return self.gemm_dtype != torch.float32

    def exact(self) -> Kernels:
        """The same kernels with float32 products (for a layer whose precision matters more than its cost)."""
        return Kernels(self.invariant)


def bf16_gemms_supported() -> bool:
    """Whether this CPU runs bfloat16 GEMMs natively (AVX512-BF16 or AMX); without, they are slower than fp32."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def _to_result(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A lowered product's result as float32, plus the (float32) bias."""
    y = y.float()
    return y if bias is None else y.add_(bias)


class Linear:
    """y = x W^T + b over the last dim of x [B, T, in] (or [B, in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> None:
        weight = weight.detach()  # [out, in]
        self.bias = None if bias is None else bias.detach()  # [out]
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.invariant = kernels.invariant
        self.lowered = kernels.lowered
        self.gemm_dtype = kernels.gemm_dtype
        self.weight = weight.contiguous().to(self.gemm_dtype)  # [out, in] for F.linear
        # [in, out'] for baddbmm, out' padded to a multiple of 16 (see GEMM_COLUMN_MULTIPLE).
        self._columns = _gemm_columns(self.out_features)
        self.weight_t = F.pad(weight.t(), (0, self._columns - self.out_features)).contiguous().to(self.gemm_dtype)
        self._bias_padded = None if self.bias is None else F.pad(self.bias, (0, self._columns - self.out_features))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not _invariant_now(self.invariant):
            if self.lowered:
                return _to_result(F.linear(x.to(self.gemm_dtype), self.weight), self.bias)
            return F.linear(x, self.weight, self.bias)
        squeeze = x.dim() == 2
        x3 = x[:, None] if squeeze else x  # [B, T, in]
        rows = x3.shape[1]
        if rows < MIN_GEMM_ROWS:
            x3 = F.pad(x3, (0, 0, 0, MIN_GEMM_ROWS - rows))
        y = _batched(self._product, x3)[:, :rows, :self.out_features]
        return y[:, 0] if squeeze else y  # [B, T, out] or [B, out]

    def _product(self, x3: torch.Tensor) -> torch.Tensor:
        weight = self.weight_t.expand(x3.shape[0], self.in_features, self._columns)
        if self.lowered:
            return _to_result(_one_thread_bmm(x3.to(self.gemm_dtype), weight), self._bias_padded)
        return torch.bmm(x3, weight) if self._bias_padded is None else torch.baddbmm(self._bias_padded, x3, weight)

    @staticmethod
    def of(module: Any, kernels: Kernels) -> Linear:
        """From an nn.Linear, or a kernel-1 nn.Conv1d (the linear layer it is, channels-last)."""
        weight = module.weight.detach()
        if isinstance(module, torch.nn.Conv1d):
            if module.kernel_size != (1,) or module.stride != (1,) or module.padding != (0,) or module.groups != 1:
                raise ValueError("only a pointwise convolution is a linear layer")
            weight = weight[:, :, 0]
        return Linear(weight, module.bias, kernels)


class Conv1d:
    """A convolution on channels-last x [B, T, C_in] that is already padded: out [B, T_out, C_out] with
    T_out = (T - dilation * (kernel - 1) - 1) // stride + 1. Callers pad (zeros, a cached prefix, ...)."""

    def __init__(self, module: Any, kernels: Kernels) -> None:
        if module.groups != 1:
            raise ValueError("grouped convolutions are not used by S3Gen")
        weight = module.weight.detach()  # [out, in, k] (weight norm resolved by the access)
        self.kernel = int(weight.shape[2])
        self.stride = int(module.stride[0])
        self.dilation = int(module.dilation[0])
        self.in_channels = int(weight.shape[1])
        self.out_channels = int(weight.shape[0])
        self.bias = None if module.bias is None else module.bias.detach()
        self.invariant = kernels.invariant
        self.lowered = kernels.lowered
        self.gemm_dtype = kernels.gemm_dtype
        self.weight = weight.contiguous().to(self.gemm_dtype)  # [out, in, k] for F.conv1d
        self._columns = _gemm_columns(self.out_channels)
        taps = weight.permute(2, 1, 0)  # [k, in, out]: one [in, out] matrix per tap
        self.taps = F.pad(taps, (0, self._columns - self.out_channels)).contiguous()  # [k, in, out']
        if self.lowered:  # the taps stacked: one [k in, out'] matrix for the unfolded input
            self.taps = self.taps.reshape(self.kernel * self.in_channels, self._columns).to(self.gemm_dtype)
        self._bias_padded = None if self.bias is None else F.pad(self.bias, (0, self._columns - self.out_channels))

    @property
    def receptive_field(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_len(self, in_len: int) -> int:
        return (in_len - self.receptive_field) // self.stride + 1

    def __call__(self, x: torch.Tensor, padding: int = 0) -> torch.Tensor:
        """`padding` zeros on both sides of x's time axis first (the library's kernels take them as the
        convolution's own padding: no padded copy of x)."""
        if not _invariant_now(self.invariant):
            if self.lowered:
                y = F.conv1d(x.transpose(1, 2).to(self.gemm_dtype), self.weight, stride=self.stride,
                             padding=padding, dilation=self.dilation)
                return _to_result(y.transpose(1, 2), self.bias)
            y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, stride=self.stride, padding=padding,
                         dilation=self.dilation)
            return y.transpose(1, 2)
        if padding:
            x = F.pad(x, (0, 0, padding, padding))
        out_len = self.out_len(x.shape[1])
        if out_len < MIN_GEMM_ROWS:  # pad to enough output rows, cut them off after
            x = F.pad(x, (0, 0, 0, (MIN_GEMM_ROWS - out_len) * self.stride))
            return self(x)[:, :out_len]
        out = _batched(self._unfolded_product if self.lowered else self._taps_product, x)
        return out if self._columns == self.out_channels else out[:, :, :self.out_channels]

    def _taps_product(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over taps of (shifted x) @ tap: [B, T, C_in] -> [B, T_out, C_out'] (T_out >= MIN_GEMM_ROWS)."""
        batch, in_len, _ = x.shape
        out_len = self.out_len(in_len)
        span = (out_len - 1) * self.stride + 1
        shifted = x[:, 0:span:self.stride]  # [B, T_out, C_in], a strided view
        weight = self.taps[0].expand(batch, self.in_channels, self._columns)
        out = torch.bmm(shifted, weight) if self._bias_padded is None else \
            torch.baddbmm(self._bias_padded, shifted, weight)
        for tap in range(1, self.kernel):
            start = tap * self.dilation
            shifted = x[:, start:start + span:self.stride]
            out = torch.baddbmm(out, shifted, self.taps[tap].expand(batch, self.in_channels, self._columns))
        return out

    def _unfolded_product(self, x: torch.Tensor) -> torch.Tensor:
        """Lowered: the k shifted views side by side [B, T_out, k C_in] (one copy, in the GEMM dtype) @ the stacked
        taps -> [B, T_out, C_out'] float32 (T_out >= MIN_GEMM_ROWS)."""
        batch, in_len, channels = x.shape
        out_len = self.out_len(in_len)
        x = x.to(self.gemm_dtype).contiguous()
        time_stride, channel_stride = x.stride(1), x.stride(2)
        windows = x.as_strided((batch, out_len, self.kernel, channels),
                               (x.stride(0), time_stride * self.stride, time_stride * self.dilation, channel_stride))
        unfolded = windows.reshape(batch, out_len, self.kernel * channels)
        weight = self.taps.expand(batch, self.kernel * channels, self._columns)
        return _to_result(_one_thread_bmm(unfolded, weight), self._bias_padded)


class ConvTranspose1d:
    """A transposed convolution on channels-last x [B, T, C_in] -> [B, (T - 1) * stride + k - 2 * padding, C_out]."""

    def __init__(self, module: Any, kernels: Kernels) -> None:
        if module.groups != 1 or module.dilation[0] != 1 or module.output_padding[0] != 0:
            raise ValueError("only plain transposed convolutions are used by S3Gen")
        weight = module.weight.detach()  # [in, out, k]
        self.kernel = int(weight.shape[2])
        self.stride = int(module.stride[0])
        self.padding = int(module.padding[0])
        self.in_channels = int(weight.shape[0])
        self.out_channels = int(weight.shape[1])
        self.bias = None if module.bias is None else module.bias.detach()
        self.invariant = kernels.invariant
        self.lowered = kernels.lowered
        self.gemm_dtype = kernels.gemm_dtype
        self.weight = weight.contiguous().to(self.gemm_dtype)
        self.taps = weight.permute(0, 2, 1).reshape(self.in_channels, self.kernel * self.out_channels)  # [in, k out]
        self._columns = _gemm_columns(self.kernel * self.out_channels)
        self.taps = F.pad(self.taps, (0, self._columns - self.kernel * self.out_channels)).contiguous()
        self.taps = self.taps.to(self.gemm_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        batch, in_len, _ = x.shape
        if not _invariant_now(self.invariant):
            if self.lowered:
                y = F.conv_transpose1d(x.transpose(1, 2).to(self.gemm_dtype), self.weight, stride=self.stride,
                                       padding=self.padding)
                return _to_result(y.transpose(1, 2), self.bias)
            y = F.conv_transpose1d(x.transpose(1, 2), self.weight, self.bias, stride=self.stride,
                                   padding=self.padding)
            return y.transpose(1, 2)
        if in_len < MIN_GEMM_ROWS:
            x = F.pad(x, (0, 0, 0, MIN_GEMM_ROWS - in_len))
        taps = _batched(self._taps_product, x)
        taps = taps[:, :in_len, :self.kernel * self.out_channels]
        taps = taps.reshape(batch, in_len, self.kernel, self.out_channels)  # [B, T, k, C_out]
        full_len = (in_len - 1) * self.stride + self.kernel
        # input t feeds output t * stride + tap: an overlap-add (col2im, each output summed in a fixed order)
        columns = taps.permute(0, 3, 2, 1).reshape(batch, self.out_channels * self.kernel, in_len)
        out = F.fold(columns, output_size=(1, full_len), kernel_size=(1, self.kernel), stride=(1, self.stride))
        out = out[:, :, 0, self.padding:full_len - self.padding].transpose(1, 2)  # [B, T_out, C_out]
        return out if self.bias is None else out + self.bias

    def _taps_product(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C_in] @ [C_in, k C_out'] -> float32 (lowered: the product in the GEMM dtype)."""
        weight = self.taps.expand(x.shape[0], self.in_channels, self._columns)
        if self.lowered:
            return _to_result(_one_thread_bmm(x.to(self.gemm_dtype), weight), None)
        return torch.bmm(x, weight)
