"""synth/invariant_ops.py: the kernels compute what torch's do, and on the CPU a row's bits do not depend on the
rows batched with it (nor on its position in the batch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from synth import invariant_ops as ops

BATCHES = (1, 2, 3, 8)


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """fn on each row alone, on prefixes of the batch, and on the batch reversed, gives the batch's rows."""
    full = fn(x)
    alone = all(torch.equal(fn(x[b:b + 1])[0], full[b]) for b in range(x.shape[0]))
    prefixes = all(torch.equal(fn(x[:n]), full[:n]) for n in BATCHES if n <= x.shape[0])
    reversed_ = torch.equal(fn(x.flip(0)).flip(0), full)
    return alone and prefixes and reversed_


@pytest.mark.parametrize("rows", [1, 2, 3, 19])
@pytest.mark.parametrize("out_features", [1, 2, 7, 64, 257])
def test_linear_is_the_library_linear_and_row_invariant(out_features: int, rows: int) -> None:
    """Odd column counts and 1-3 rows per matrix are the shapes where MKL's batched GEMM alone is not."""
    torch.manual_seed(0)
    module = torch.nn.Linear(48, out_features)
    x = torch.randn(8, rows, 48)
    with torch.inference_mode():
        for invariant in (True, False):
            linear = ops.Linear.of(module, invariant)
            torch.testing.assert_close(linear(x), module(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(linear(x[:, 0]), module(x[:, 0]), rtol=1e-5, atol=1e-5)
        assert _rows_invariant(ops.Linear.of(module, True), x)
        assert _rows_invariant(ops.Linear.of(module, True), x[:, 0])  # [B, in] rows too


@pytest.mark.parametrize("length", [6, 241])
@pytest.mark.parametrize("kernel,dilation,stride,padding", [(3, 1, 1, 1), (7, 3, 1, 9), (11, 5, 1, 25), (30, 1, 15, 7),
                                                           (4, 1, 1, 0), (1, 1, 1, 0)])
def test_conv1d_is_the_library_conv_and_row_invariant(kernel: int, dilation: int, stride: int, padding: int,
                                                      length: int) -> None:
    torch.manual_seed(0)
    module = torch.nn.Conv1d(18, 7, kernel, stride=stride, dilation=dilation, padding=padding)
    x = torch.randn(8, 18, max(length, kernel + 2 * stride))  # channels-first for the library; 1-4 outputs at 6
    with torch.inference_mode():
        reference = module(x).transpose(1, 2)  # [B, T_out, 24]
        padded = F.pad(x.transpose(1, 2), (0, 0, padding, padding))  # ops convs take padded channels-last input
        for invariant in (True, False):
            conv = ops.Conv1d(module, invariant)
            torch.testing.assert_close(conv(padded), reference, rtol=1e-5, atol=1e-5)
        assert _rows_invariant(ops.Conv1d(module, True), padded)


@pytest.mark.parametrize("kernel,stride", [(16, 8), (11, 5), (7, 3)])  # HiFT's upsampling layers
def test_conv_transpose_is_the_library_one_and_row_invariant(kernel: int, stride: int) -> None:
    torch.manual_seed(0)
    module = torch.nn.ConvTranspose1d(32, 16, kernel, stride, padding=(kernel - stride) // 2)
    x = torch.randn(8, 32, 50)
    with torch.inference_mode():
        reference = module(x).transpose(1, 2)
        for invariant in (True, False):
            up = ops.ConvTranspose1d(module, invariant)
            torch.testing.assert_close(up(x.transpose(1, 2)), reference, rtol=1e-5, atol=1e-5)
        assert _rows_invariant(ops.ConvTranspose1d(module, True), x.transpose(1, 2).contiguous())


def test_rows_do_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(0)
    module = torch.nn.Conv1d(64, 64, 7, dilation=3)
    x = torch.randn(4, 300, 64)
    conv = ops.Conv1d(module, True)
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = conv(x)
            torch.set_num_threads(2)
            two = conv(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)
