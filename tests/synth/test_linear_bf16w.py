"""The bf16-weight projection kernel (synth/linear_bf16w.c): fp32 accuracy, bitwise batch invariance, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from synth import linear_bf16w
from synth.api import EngineConfig, EngineError
from synth.engine import Engine
from synth.loading import random_bundle

# The kernel is built for AVX-512 CPUs only (elsewhere the engine refuses cpu_weights="bf16" with a clear
# error, which test_refused_without_avx512 checks on every machine).
HAS_AVX512 = "AVX512" in torch.backends.cpu.get_cpu_capability()
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="the bf16-weight kernel needs an AVX-512 CPU")

SHAPES = [(1024, 200), (300, 130), (64, 64), (17, 5), (2048, 1)]  # (in K, out N): ragged blocks, odd K


def _case(k: int, n: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16).float()  # bf16-representable
    return torch.randn(rows, k, generator=g), weight, torch.randn(n, generator=g)


@needs_avx512
@pytest.mark.parametrize("k,n", SHAPES)
def test_matches_float64_within_the_fp32_summation_bound(k: int, n: int) -> None:
    x, weight, bias = _case(k, n, 9, seed=k + n)
    packed = linear_bf16w.pack(weight)
    got = linear_bf16w.linear(x, packed, n, bias).double()
    exact = F.linear(x.double(), weight.double(), bias.double())
    # A sequential fp32 chain of K FMAs then the bias: |error| <= (K + 1) u (|x| |w|^T + |b|) with u = 2^-24
    # (Higham, gamma_n), which is the bound any fp32 dot product of this length meets.
    bound = (k + 1) * 2.0**-24 * (F.linear(x.double().abs(), weight.double().abs(), bias.double().abs()))
    assert torch.all((got - exact).abs() <= bound)
    # and the error is fp32 rounding, not a lost term: far below one product's size
    assert (got - exact).abs().max() < 1e-3 * exact.abs().max()


@needs_avx512
@pytest.mark.parametrize("k,n", SHAPES[:3])
def test_a_rows_result_does_not_depend_on_the_other_rows(k: int, n: int) -> None:
    x, weight, bias = _case(k, n, 40, seed=7)
    packed = linear_bf16w.pack(weight)
    full = linear_bf16w.linear(x, packed, n, bias)
    for start, stop in [(0, 1), (3, 4), (0, 7), (5, 13), (0, 6), (6, 12), (39, 40), (2, 33)]:
        part = linear_bf16w.linear(x[start:stop].clone(), packed, n, bias)
        assert torch.equal(part, full[start:stop]), (start, stop)


@needs_avx512
def test_threads_strides_and_bias_do_not_change_the_arithmetic() -> None:
    k, n = 256, 150
    x, weight, bias = _case(k, n, 5, seed=3)
    packed = linear_bf16w.pack(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear_bf16w.linear(x, packed, n, bias)
        torch.set_num_threads(2)
        two = linear_bf16w.linear(x, packed, n, bias)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    wide = torch.randn(5, 3 * k)
    wide[:, k:2 * k] = x
    strided = linear_bf16w.linear(wide[:, k:2 * k], packed, n, bias)  # rows 3k apart, not contiguous
    assert torch.equal(strided, one)
    no_bias = linear_bf16w.linear(x, packed, n)
    assert torch.equal(no_bias + bias, one)  # the bias is one add after the chain
    batched = linear_bf16w.linear(x.view(5, 1, k), packed, n, bias)
    assert batched.shape == (5, 1, n) and torch.equal(batched[:, 0], one)
    assert linear_bf16w.linear(torch.empty(0, k), packed, n, bias).shape == (0, n)


@needs_avx512
def test_round_to_bf16_is_idempotent_and_required() -> None:
    layer = torch.nn.Linear(40, 30)
    with pytest.raises(ValueError, match="round_to_bf16_"):
        linear_bf16w.Bf16WeightLinears([layer])
    changed = linear_bf16w.round_to_bf16_([layer])
    assert changed > 1000  # nearly every random fp32 value moves
    assert linear_bf16w.round_to_bf16_([layer]) == 0
    linears = linear_bf16w.Bf16WeightLinears([layer])
    x = torch.randn(3, 40)
    got = linears(layer, x)
    assert torch.allclose(got, layer(x), rtol=1e-5, atol=1e-5)
    assert linears.nbytes == 64 * 40 * 2  # 30 outputs padded to one block of 64, bf16


@needs_avx512
def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENT_SERVER_KERNEL_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    linear_bf16w._library.cache_clear()
    try:
        with pytest.raises(linear_bf16w.KernelUnavailable, match=r"failed|compiler"):
            linear_bf16w.available(raise_error=True)
        assert not linear_bf16w.available()
    finally:
        linear_bf16w._library.cache_clear()
        monkeypatch.undo()
    assert linear_bf16w.available()


def test_engine_refuses_bf16_weights_where_they_do_not_apply() -> None:
    bundle = random_bundle("turbo", "tiny", torch.device("cpu"))
    with pytest.raises(EngineError, match="'fp32' or 'bf16'"):
        Engine(bundle, EngineConfig(variant="turbo", weights="random-tiny", device="cpu", cpu_weights="int8",
                                    max_slots=1, max_context_tokens=256), render_audio=False)
    with pytest.raises(EngineError, match="dtype float32"):
        Engine(bundle, EngineConfig(variant="turbo", weights="random-tiny", device="cpu", dtype="bfloat16",
                                    cpu_weights="bf16", max_slots=1, max_context_tokens=256), render_audio=False)


def test_refused_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    linear_bf16w._library.cache_clear()
    try:
        with pytest.raises(linear_bf16w.KernelUnavailable, match="needs an AVX-512 CPU"):
            linear_bf16w.available(raise_error=True)
        bundle = random_bundle("turbo", "tiny", torch.device("cpu"))
        with pytest.raises(EngineError, match="AVX-512"):
            Engine(bundle, EngineConfig(variant="turbo", weights="random-tiny", device="cpu", cpu_weights="bf16",
                                        max_slots=1, max_context_tokens=256), render_audio=False)
    finally:
        monkeypatch.undo()
        linear_bf16w._library.cache_clear()
