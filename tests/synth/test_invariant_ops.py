"""synth/invariant_ops.py: the kernels compute what torch's do, and on the CPU a row's bits do not depend on the
rows batched with it (nor on its position in the batch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from synth import invariant_ops as ops

BATCHES = (1, 2, 3, 8)
GEMM_DTYPES = pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, gemm_dtype: torch.dtype) -> None:
    """Against the float32 library layer: fp32 products to rounding; bf16 products (inputs and weights rounded to
    8 bits of mantissa, sums over <= 330 terms) to ~1 %."""
    rtol, atol = (1e-5, 1e-5) if gemm_dtype == torch.float32 else (2e-2, 3e-2)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """fn on each row alone, on prefixes of the batch, and on the batch reversed, gives the batch's rows."""
    full = fn(x)
    alone = all(torch.equal(fn(x[b:b + 1])[0], full[b]) for b in range(x.shape[0]))
    prefixes = all(torch.equal(fn(x[:n]), full[:n]) for n in BATCHES if n <= x.shape[0])
    reversed_ = torch.equal(fn(x.flip(0)).flip(0), full)
    return alone and prefixes and reversed_


@pytest.mark.parametrize("rows", [1, 2, 3, 19])
@pytest.mark.parametrize("out_features", [1, 2, 7, 64, 257])
@GEMM_DTYPES
def test_linear_is_the_library_linear_and_row_invariant(out_features: int, rows: int, gemm_dtype: torch.dtype) -> None:
    """Odd column counts and 1-3 rows per matrix are the shapes where MKL's batched GEMM alone is not."""
    torch.manual_seed(0)
    module = torch.nn.Linear(48, out_features)
    x = torch.randn(8, rows, 48)
    with torch.inference_mode():
        for invariant in (True, False):
            linear = ops.Linear.of(module, ops.Kernels(invariant, gemm_dtype))
            assert linear(x).dtype == torch.float32
            _assert_close(linear(x), module(x), gemm_dtype)
            _assert_close(linear(x[:, 0]), module(x[:, 0]), gemm_dtype)
        invariant_linear = ops.Linear.of(module, ops.Kernels(True, gemm_dtype))
        assert _rows_invariant(invariant_linear, x)
        assert _rows_invariant(invariant_linear, x[:, 0])  # [B, in] rows too


@pytest.mark.parametrize("length", [6, 241])
@pytest.mark.parametrize("kernel,dilation,stride,padding", [(3, 1, 1, 1), (7, 3, 1, 9), (11, 5, 1, 25), (30, 1, 15, 7),
                                                           (4, 1, 1, 0), (1, 1, 1, 0)])
@GEMM_DTYPES
def test_conv1d_is_the_library_conv_and_row_invariant(kernel: int, dilation: int, stride: int, padding: int,
                                                      length: int, gemm_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = torch.nn.Conv1d(18, 7, kernel, stride=stride, dilation=dilation, padding=padding)
    x = torch.randn(8, 18, max(length, kernel + 2 * stride))  # channels-first for the library; 1-4 outputs at 6
    with torch.inference_mode():
        reference = module(x).transpose(1, 2)  # [B, T_out, 24]
        padded = F.pad(x.transpose(1, 2), (0, 0, padding, padding))  # ops convs take padded channels-last input
        for invariant in (True, False):
            conv = ops.Conv1d(module, ops.Kernels(invariant, gemm_dtype))
            _assert_close(conv(padded), reference, gemm_dtype)
            _assert_close(conv(x.transpose(1, 2), padding=padding), reference, gemm_dtype)  # the pad taken along
        assert _rows_invariant(ops.Conv1d(module, ops.Kernels(True, gemm_dtype)), padded)


@pytest.mark.parametrize("kernel,stride", [(16, 8), (11, 5), (7, 3)])  # HiFT's upsampling layers
@GEMM_DTYPES
def test_conv_transpose_is_the_library_one_and_row_invariant(kernel: int, stride: int, gemm_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = torch.nn.ConvTranspose1d(32, 16, kernel, stride, padding=(kernel - stride) // 2)
    x = torch.randn(8, 32, 50)
    with torch.inference_mode():
        reference = module(x).transpose(1, 2)
        for invariant in (True, False):
            up = ops.ConvTranspose1d(module, ops.Kernels(invariant, gemm_dtype))
            _assert_close(up(x.transpose(1, 2)), reference, gemm_dtype)
        channels_last = x.transpose(1, 2).contiguous()
        assert _rows_invariant(ops.ConvTranspose1d(module, ops.Kernels(True, gemm_dtype)), channels_last)


@GEMM_DTYPES
def test_rows_do_not_depend_on_the_thread_count(gemm_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    module = torch.nn.Conv1d(64, 64, 7, dilation=3)
    x = torch.randn(4, 300, 64)
    conv = ops.Conv1d(module, ops.Kernels(True, gemm_dtype))
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


@pytest.mark.parametrize("layer,rows", [("linear", 8), ("conv", 40)], ids=["linear-3072-256", "conv-512-k4"])
def test_lowered_rows_keep_their_bits_on_two_threads_at_s3gen_sizes(layer: str, rows: int) -> None:
    """bf16 products with few rows and long sums (oneDNN's AMX kernels split these sums between two threads: a
    row's bits then change with the batch and the thread count; the convolution is one of the tiny English model's
    that failed a vocoder test so) give each row the bits it gets alone on one thread, when batched with others on
    a thread whose count is 2 (a lent render)."""
    torch.manual_seed(0)
    if layer == "linear":
        module: torch.nn.Module = torch.nn.Linear(3072, 256)
        x = torch.randn(3, rows, 3072)
        op: Callable[[torch.Tensor], torch.Tensor] = ops.Linear.of(module, ops.Kernels(True, torch.bfloat16))
    else:
        module = torch.nn.Conv1d(512, 512, 4)
        x = torch.randn(3, rows, 512)
        op = ops.Conv1d(module, ops.Kernels(True, torch.bfloat16))
    saved = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            alone = [op(x[b:b + 1])[0] for b in range(3)]
            torch.set_num_threads(2)
            batched = op(x)
            assert torch.get_num_threads() == 2  # the product restored the caller's count
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(batched[b], alone[b]) for b in range(3))


def test_bf16_products_are_bf16_and_close_to_fp32() -> None:
    """The lowered kernels really run in bfloat16 (their results leave fp32's bits) and stay within bf16's
    rounding of the float32 layer: a convolution's taps are one product (one rounding of each input), not a sum
    of per-tap products each rounded on its own."""
    torch.manual_seed(0)
    module = torch.nn.Conv1d(64, 64, 11, dilation=5)
    x = torch.randn(2, 400, 64)
    with torch.inference_mode():
        exact = ops.Conv1d(module, ops.Kernels(True))(x)
        lowered = ops.Conv1d(module, ops.Kernels(True, torch.bfloat16))(x)
        # what the unfolded product is: bf16 inputs and weights, float32 sums
        rounded = torch.nn.Conv1d(64, 64, 11, dilation=5)
        rounded.weight.copy_(module.weight.bfloat16().float())
        assert rounded.bias is not None and module.bias is not None
        rounded.bias.copy_(module.bias)
        expected = rounded(x.bfloat16().float().transpose(1, 2)).transpose(1, 2)
    assert lowered.dtype == torch.float32 and not torch.equal(lowered, exact)
    relative = ((lowered - exact).norm() / exact.norm()).item()
    assert 1e-4 < relative < 1e-2
    # only the product's output is rounded (relative error ~2^-9 / sqrt(3) = 1.1e-3; measured 1.7e-3), where
    # summing per-tap bf16 products rounds every partial sum (measured 4.6e-3)
    assert ((lowered - expected).norm() / expected.norm()).item() < 2.5e-3
    with pytest.raises(ValueError, match="gemm_dtype"):
        ops.Kernels(True, torch.float16)
