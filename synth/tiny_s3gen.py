"""Builders for random-weight S3Gen instances (tests, benchmarks).

`build_s3gen("tiny", ...)` returns the library's real `S3Gen` class: its `__init__` runs unchanged, every
method is the library's own. Only the sub-module constructors it calls are swapped, for the duration of
the call, for ones with smaller widths and depths. What cannot shrink stays as built by the library: the
flow's 512-wide token embedding, the encoder's pre-lookahead and upsample layers (hard-coded at 512
channels, so the encoder stays 512 wide), the encoder's 4 up-blocks, the S3 tokenizer's 64-wide attention
heads (its rotary table is built for head size 64), the speaker embedding size (192) and the 80 mel bins.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import s3tokenizer.model_v2 as s3tok_v2
import torch
from chatterbox.models.s3gen import S3Gen
from chatterbox.models.s3gen import s3gen as s3gen_module

Preset = Literal["tiny", "full"]

# Keyword overrides applied to the library's own constructor calls when building the tiny preset.
_TINY_ENCODER = {"linear_units": 64, "num_blocks": 1}  # width stays 512 (see module docstring)
_TINY_ESTIMATOR = {"channels": [32], "attention_head_dim": 16, "num_heads": 2, "n_blocks": 1, "num_mid_blocks": 1}
_TINY_SPEAKER_ENCODER = {"growth_rate": 8, "bn_size": 2, "init_channels": 32}
_TINY_HIFT = {"base_channels": 32}
_TINY_F0_PREDICTOR = {"cond_channels": 32}
_TINY_TOKENIZER_STATE = 128  # 2 heads of the fixed head size 64
_TINY_TOKENIZER_HEADS = 2
_TINY_TOKENIZER_LAYERS = 1

# The library's constructors, captured before any swap.
_AudioEncoderV2 = s3tok_v2.AudioEncoderV2
_FSQVectorQuantization = s3tok_v2.FSQVectorQuantization


def build_s3gen(preset: Preset, meanflow: bool) -> S3Gen:
    """A random-weight `S3Gen` in eval mode; deterministic given the global torch seed.

    English uses `meanflow=False` (10 CFM steps with CFG); Turbo uses `meanflow=True` (2 mean-flow steps).
    """
    if preset == "full":
        return S3Gen(meanflow=meanflow).eval()
    if preset != "tiny":
        raise ValueError(f"unknown preset {preset!r}")
    with _tiny_constructors():
        model = S3Gen(meanflow=meanflow)
    return model.eval()


def _with_overrides(factory: Callable[..., Any], overrides: dict[str, Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> Any:
        return factory(*args, **{**kwargs, **overrides})

    return build


def _tiny_audio_encoder(
    n_mels: int, n_state: int, n_head: int, n_layer: int, stride: int, use_sdpa: bool
) -> torch.nn.Module:
    del n_state, n_head, n_layer
    return _AudioEncoderV2(
        n_mels, _TINY_TOKENIZER_STATE, _TINY_TOKENIZER_HEADS, _TINY_TOKENIZER_LAYERS, stride, use_sdpa
    )


def _tiny_quantizer(dim: int, codebook_size: int) -> torch.nn.Module:
    del dim
    return _FSQVectorQuantization(_TINY_TOKENIZER_STATE, codebook_size)


@contextlib.contextmanager
def _tiny_constructors() -> Iterator[None]:
    """Swap the constructors `S3Gen.__init__` looks up, restoring them afterwards (not thread-safe)."""
    swaps: list[tuple[Any, str, Any]] = [
        (s3gen_module, "UpsampleConformerEncoder",
         _with_overrides(s3gen_module.UpsampleConformerEncoder, _TINY_ENCODER)),
        (s3gen_module, "ConditionalDecoder", _with_overrides(s3gen_module.ConditionalDecoder, _TINY_ESTIMATOR)),
        (s3gen_module, "CAMPPlus", _with_overrides(s3gen_module.CAMPPlus, _TINY_SPEAKER_ENCODER)),
        (s3gen_module, "HiFTGenerator", _with_overrides(s3gen_module.HiFTGenerator, _TINY_HIFT)),
        (s3gen_module, "ConvRNNF0Predictor",
         _with_overrides(s3gen_module.ConvRNNF0Predictor, _TINY_F0_PREDICTOR)),
        (s3tok_v2, "AudioEncoderV2", _tiny_audio_encoder),
        (s3tok_v2, "FSQVectorQuantization", _tiny_quantizer),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, replacement in swaps:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
