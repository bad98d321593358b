"""synth/hift.py against the library's HiFTGenerator.inference, fed the same random draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from chatterbox.models.s3gen.hifigan import HiFTGenerator

from synth import invariant_ops as ops
from synth.hift import BatchedHift
from synth.tiny_s3gen import build_s3gen

FRAMES = 30
CARRIED_FRAMES = 8


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    torch.manual_seed(0)
    return build_s3gen("tiny", meanflow=False).mel2wav


def library_draws(harmonics: int, samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What SineGen draws from a global RNG seeded with `seed`: phases (Uniform(-pi, pi), the fundamental's
    set to 0) then standard normals."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.rand((1, harmonics, 1), generator=g)
    low, high = torch.tensor(-np.pi, dtype=torch.float32), torch.tensor(np.pi, dtype=torch.float32)
    phases = (low + rand * (high - low))[:, :, 0]
    phases[:, 0] = 0
    return phases, torch.randn((1, harmonics, samples), generator=g)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("carried", [True, False])
def test_is_the_library_hift(hift: HiFTGenerator, invariant: bool, carried: bool) -> None:
    mine = BatchedHift(hift, ops.Kernels(invariant))
    g = torch.Generator().manual_seed(1)
    mel = torch.randn(1, 80, FRAMES, generator=g) * 2 - 5
    cache = torch.randn(1, 1, CARRIED_FRAMES * 480 if carried else 0, generator=g) * 0.1
    phases, noise = library_draws(mine.harmonics, FRAMES * 480, seed=123)
    with torch.inference_mode():
        with torch.random.fork_rng():
            torch.manual_seed(123)
            reference_wav, reference_source = hift.inference(mel, cache)
        wav, source = mine(mel.transpose(1, 2), phases, noise, torch.nn.functional.pad(cache[:, 0], (0, 16)),
                           torch.tensor([cache.shape[2]]))
    torch.testing.assert_close(wav, reference_wav, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(source, reference_source[:, 0], rtol=1e-5, atol=1e-5)
    if carried:
        assert torch.equal(source[:, :cache.shape[2]], cache[:, 0])


def test_rows_are_independent(hift: HiFTGenerator) -> None:
    """Each row's waveform is its own: alone or in a batch of 4 with others (other mels, draws, carried
    sources), bitwise."""
    mine = BatchedHift(hift, ops.Kernels(True))
    g = torch.Generator().manual_seed(2)
    mels = torch.randn(4, FRAMES, 80, generator=g)
    phases = torch.rand(4, mine.harmonics, generator=g)
    noise = torch.randn(4, mine.harmonics, FRAMES * 480, generator=g)
    carried = torch.randn(4, CARRIED_FRAMES * 480, generator=g)
    carried_samples = torch.tensor([CARRIED_FRAMES * 480, 0, 3 * 480, 0])
    with torch.inference_mode():
        batch, _ = mine(mels, phases, noise, carried, carried_samples)
        for row in range(4):
            alone, _ = mine(mels[row:row + 1], phases[row:row + 1], noise[row:row + 1], carried[row:row + 1],
                            carried_samples[row:row + 1])
            assert torch.equal(alone[0], batch[row])
