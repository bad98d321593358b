"""HiFT (mel -> 24 kHz waveform) as an explicit batched function whose randomness is an input.

The library's `HiFTGenerator.inference(mel, cache_source)` draws its sine source's random harmonic phases and
additive noise from the global RNG (so the caller had to reseed and restore the global generator around every
call, and a stream's audio depended on anything else drawing from it), and runs one mel at a time. Here:

- each row brings its own phases [B, harmonics] and standard-normal noise [B, harmonics, samples], drawn by the
  caller per (stream seed, absolute position) (`synth/counter_noise.py`);
- rows are mels of equal (bucket) length; a row's carried-over source excitation of the previous call replaces
  the first samples of its source, as `cache_source` does;
- everything runs channels-last through the row-invariant kernels of `synth/invariant_ops.py`, the 16-point
  STFT and inverse STFT included: they are written out as products with the DFT matrices (torch's FFTs give
  other bits with 1 or 2 threads, measured; and torch.istft checks its window envelope on the host, which a
  CUDA graph cannot capture). Overlap-add and envelope by F.fold.

With the same mel, phases and noise it computes what `HiFTGenerator.inference` computes, to float rounding
(tests/synth/test_vocoder.py feeds the library the same draws through the global RNG).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from chatterbox.models.s3gen.hifigan import HiFTGenerator

from synth import invariant_ops as ops
from synth.render_checkpoints import checkpoint

SNAKE_EPSILON = 1e-9  # Snake's no_div_by_zero


class _ResBlock:
    def __init__(self, block: Any, kernels: ops.Kernels) -> None:
        self.convs1 = [ops.Conv1d(c, kernels) for c in block.convs1]
        self.convs2 = [ops.Conv1d(c, kernels) for c in block.convs2]
        self.snakes1 = [_Snake(a.alpha.detach()) for a in block.activations1]
        self.snakes2 = [_Snake(a.alpha.detach()) for a in block.activations2]
        if any(a.alpha_logscale for a in (*block.activations1, *block.activations2)):
            raise RuntimeError("expected linear-scale Snake activations")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, snake1, snake2 in zip(self.convs1, self.convs2, self.snakes1, self.snakes2, strict=False):
            xt = _conv_same(conv1, snake1(x))
            xt = _conv_same(conv2, snake2(xt))
            x = xt.add_(x)  # xt is the convolution's own new tensor
            checkpoint()
        return x


class BatchedHift:
    """One HiFT generator's forward over a batch; holds no state between calls (any thread may call it)."""

    def __init__(self, hift: Any, kernels: ops.Kernels) -> None:
        if not isinstance(hift, HiFTGenerator):
            raise TypeError(f"expected chatterbox's HiFTGenerator, got {type(hift).__name__}")
        self.harmonics = int(hift.nb_harmonics) + 1
        sine = hift.m_source.l_sin_gen
        self.sample_rate_hz = int(sine.sampling_rate)
        self.sine_amp, self.noise_std, self.voiced_threshold = float(sine.sine_amp), float(sine.noise_std), \
            float(sine.voiced_threshold)
        self.samples_per_frame = int(hift.f0_upsamp.scale_factor)
        self.merge = ops.Linear.of(hift.m_source.l_linear, kernels)  # harmonics -> 1
        f0 = hift.f0_predictor
        self.f0_convs = [ops.Conv1d(m, kernels) for m in f0.condnet if isinstance(m, torch.nn.Conv1d)]
        self.f0_classifier = ops.Linear.of(f0.classifier, kernels)
        self.conv_pre = ops.Conv1d(hift.conv_pre, kernels)
        self.ups = [ops.ConvTranspose1d(m, kernels) for m in hift.ups]
        self.source_downs = [ops.Conv1d(m, kernels) for m in hift.source_downs]
        self.source_down_padding = [int(m.padding[0]) for m in hift.source_downs]
        self.source_resblocks = [_ResBlock(b, kernels) for b in hift.source_resblocks]
        self.resblocks = [_ResBlock(b, kernels) for b in hift.resblocks]
        self.kernels_per_level = int(hift.num_kernels)
        self.conv_post = ops.Conv1d(hift.conv_post, kernels)
        self.lrelu_slope = float(hift.lrelu_slope)
        self.audio_limit = float(hift.audio_limit)
        self.n_fft, self.hop = int(hift.istft_params["n_fft"]), int(hift.istft_params["hop_len"])
        if self.n_fft % self.hop:
            raise RuntimeError("the inverse STFT here expects n_fft to be a multiple of the hop")
        self.window = hift.stft_window.to(self.conv_pre.weight.device)  # [n_fft] periodic Hann
        forward, inverse = _real_dft_matrices(self.n_fft)
        device = self.window.device
        # frame [n_fft] -> (real [bins] | imag [bins]), torch.stft's sign; and back, irfft's (imag of DC and Nyquist
        # ignored), both as the same batch-invariant products as every other layer, always in float32 (cheap: 16
        # points; the phase of the output's every sample goes through them)
        self.dft = ops.Linear(forward.to(device), None, kernels.exact())  # weight [2 bins, n_fft]
        self.inverse_dft = ops.Linear(inverse.to(device), None, kernels.exact())  # weight [n_fft, 2 bins]
        if not isinstance(hift.reflection_pad, torch.nn.ReflectionPad1d) or hift.reflection_pad.padding != (1, 0):
            raise RuntimeError("unexpected reflection pad")

    def f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel [B, M, 80] -> f0 [B, M] (Hz): ConvRNNF0Predictor."""
        x = mel
        for conv in self.f0_convs:
            x = F.elu(_conv_same(conv, x))
            checkpoint()
        return torch.abs(self.f0_classifier(x)[:, :, 0])

    def source(self, f0: torch.Tensor, phases: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The neural source: f0 [B, M] (Hz), phases [B, H] (rad, row 0's first harmonic 0), noise [B, H, S]
        standard normal -> excitation [B, S] (SineGen + SourceModuleHnNSF's merge)."""
        f0_samples = f0.repeat_interleave(self.samples_per_frame, dim=1)[:, None, :]  # [B, 1, S]
        harmonic = torch.arange(1, self.harmonics + 1, device=f0.device, dtype=f0.dtype)[None, :, None]
        per_sample = f0_samples * harmonic / self.sample_rate_hz  # [B, H, S] cycles per sample
        theta = 2 * math.pi * (torch.cumsum(per_sample, dim=-1) % 1)
        sine = self.sine_amp * torch.sin(theta + phases[:, :, None])
        uv = (f0_samples > self.voiced_threshold).to(torch.float32)  # [B, 1, S]
        noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
        sine = sine * uv + noise_amp * noise
        return torch.tanh(self.merge(sine.transpose(1, 2)))[:, :, 0]  # [B, S]

    def __call__(self, mel: torch.Tensor, phases: torch.Tensor, noise: torch.Tensor, carried: torch.Tensor,
                 carried_samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mel [B, M, 80]; phases [B, H]; noise [B, H, 480 M]; carried [B, C] (C <= 480 M) source samples of the
        previous call, of which the first carried_samples[b] replace row b's -> (wav [B, 480 M], source [B, 480 M])."""
        source = self.source(self.f0(mel), phases, noise)  # [B, S]
        checkpoint()
        positions = torch.arange(carried.shape[1], device=mel.device)[None, :]
        head = torch.where(positions < carried_samples[:, None], carried, source[:, :carried.shape[1]])
        source = torch.cat([head, source[:, carried.shape[1]:]], dim=1)
        return self.decode(mel, source), source

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """HiFTGenerator.decode: mel [B, M, 80], source [B, S] -> waveform [B, S]."""
        half = self.n_fft // 2  # torch.stft(center=True): reflect-padded by n_fft / 2 on both sides
        padded = F.pad(source[:, None], (half, half), mode="reflect")[:, 0]  # [B, S + n_fft]
        framed = padded.unfold(1, self.n_fft, self.hop) * self.window  # [B, frames, n_fft]
        source_frames = self.dft(framed)  # [B, frames, 2 bins]: real parts, then imaginary parts
        x = _conv_same(self.conv_pre, mel)  # [B, M, C]
        for level, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.lrelu_slope))
            if level == len(self.ups) - 1:
                x = torch.cat([x[:, 1:2], x], dim=1)  # ReflectionPad1d((1, 0))
            pad = self.source_down_padding[level]
            si = self.source_downs[level](source_frames, padding=pad)
            x = x + self.source_resblocks[level](si)
            checkpoint()
            blocks = self.resblocks[level * self.kernels_per_level:(level + 1) * self.kernels_per_level]
            xs = blocks[0](x)  # a new tensor: summed into in place
            for block in blocks[1:]:
                xs.add_(block(x))
            x = xs.div_(self.kernels_per_level)
        x = _conv_same(self.conv_post, F.leaky_relu(x))  # [B, frames, 2F]
        bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :, :bins]).clamp(max=1e2)
        phase = torch.sin(x[:, :, bins:])
        wav = self._istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return wav.clamp(-self.audio_limit, self.audio_limit)

    def _istft(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """torch.istft(center=True, onesided, hann window) of [B, frames, bins], without its host-side check.

        Overlap-add and window envelope by F.fold (no in-place ops: torch.compile can take it in inference mode)."""
        frames = real.shape[1]
        segments = self.inverse_dft(torch.cat([real, imag], dim=2)) * self.window  # [B, frames, n_fft]: irfft
        full = (frames - 1) * self.hop + self.n_fft
        fold: dict[str, Any] = {"output_size": (1, full), "kernel_size": (1, self.n_fft), "stride": (1, self.hop)}
        out = F.fold(segments.transpose(1, 2), **fold)[:, 0, 0]  # [B, full]
        window_sq = (self.window ** 2)[None, :, None].expand(1, self.n_fft, frames)
        envelope = F.fold(window_sq, **fold)[0, 0, 0]  # [full]
        trim = self.n_fft // 2
        length = (frames - 1) * self.hop
        return out[:, trim:trim + length] / envelope[trim:trim + length]


def _real_dft_matrices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real DFT of n points as matrices (computed in float64): forward [2 (n/2 + 1), n] gives
    (Re X_k | Im X_k) with X_k = sum_t x_t e^(-2 pi i k t / n); inverse [n, 2 (n/2 + 1)] is irfft's."""
    bins = n // 2 + 1
    k, t = torch.arange(bins, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * k * t / n  # [bins, n]
    forward = torch.cat([torch.cos(angle), -torch.sin(angle)])  # [2 bins, n]
    weight = torch.full((bins, 1), 2.0, dtype=torch.float64)
    weight[0] = weight[-1] = 1.0  # DC and Nyquist once; the others stand for their conjugate pair too
    inverse = torch.cat([weight * torch.cos(angle), -weight * torch.sin(angle)]).T / n  # [n, 2 bins]
    return forward.float(), inverse.float()


class _Snake:
    """Snake on channels-last x [B, T, C]: x + sin(alpha x)^2 / alpha, the library's
    `x + (1 / (alpha + eps)) * pow(sin(x * alpha), 2)` to the bit, in one new tensor instead of five (HiFT runs 72
    of them per call over [B, samples / 8 or / 40, C]: fewer fresh pages and passes over memory)."""

    def __init__(self, alpha: torch.Tensor) -> None:
        self.alpha = alpha  # [C]
        self.inverse = 1.0 / (alpha + SNAKE_EPSILON)  # [C], once

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        wave = x * self.alpha
        return wave.sin_().square_().mul_(self.inverse).add_(x)


def _conv_same(conv: ops.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A stride-1 convolution with the library's symmetric zero padding (length kept)."""
    return conv(x, padding=(conv.receptive_field - 1) // 2)
