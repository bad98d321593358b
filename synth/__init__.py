"""The synthesis engine: Chatterbox models, slot KV cache, scheduler, batched step loop, streaming vocoder.

No asyncio here and no import of agent_server: callers use `build_engine` and the names in `synth.api`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# How long an OpenMP thread spins at a barrier before it sleeps (libgomp's default: 300,000 spins). When another
# process takes one of our cores, a 2-thread team's waiting thread spins on the core its teammate needs: a 2-thread
# decode step took 584 ms instead of 63 (the 9x collapse of issue 15); with 10,000 spins 136 ms (the 1-thread step:
# 108 ms, so the decode stops borrowing), and on an idle machine the same speed as the default (62 ms; a render too).
# BENCHMARKS.md "A stray OpenMP team". libgomp reads it once, when torch loads it: so set before torch is imported
# (the server imports synth first; a process that imported torch earlier keeps libgomp's default).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from synth.api import EngineConfig, Priority

if TYPE_CHECKING:
    from synth.engine import Engine
    from synth.loading import ModelBundle
    from synth.voices import Voice

DEFAULT_VOICE_ID = "default"


def default_voice(bundle: ModelBundle) -> Voice:
    """The checkpoint's built-in voice (conds.pt); with none, a deterministic synthetic reference clip."""
    from synth.presets import synthetic_reference_wav
    from synth.voices import make_voice, voice_from_conds

    if bundle.builtin_conds is not None:
        return voice_from_conds(DEFAULT_VOICE_ID, bundle.builtin_conds, bundle.device)
    sample_rate_hz = 24_000
    voice = make_voice(bundle, DEFAULT_VOICE_ID, synthetic_reference_wav(sample_rate_hz), sample_rate_hz)
    voice.builtin = True
    return voice


def _cap_onednn_for_a_reduced_precision_t3(config: EngineConfig) -> None:
    """T3 in bfloat16 or float16 on the CPU runs its linear layers through oneDNN, whose AMX kernels (Intel Xeon, 4th
    generation up) give a row other bits from 64 rows up (measured on CPU-4: [64+, 4096] @ [4096, 1024] and others),
    so a seeded segment's tokens could follow the row bucket it decodes in. Capped at AVX512-BF16 they do not.
    oneDNN reads the cap at its first primitive, so it is set here, before the models load (the server builds its
    engine before any other torch work). The vocoder's bf16 products keep their bits under AMX (one thread each:
    synth/invariant_ops.py), so a float32 T3 leaves AMX on. An operator's own ONEDNN_MAX_CPU_ISA wins."""
    from synth.loading import resolve_device

    if config.dtype != "float32" and resolve_device(config.device).type == "cpu":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")


def build_engine(config: EngineConfig, *, render_audio: bool = True) -> Engine:
    """Load the models (slow) and return an Engine that is not started yet."""
    from synth.engine import Engine
    from synth.loading import load_models

    _cap_onednn_for_a_reduced_precision_t3(config)
    bundle = load_models(config.variant, config.weights, config.device)
    engine = Engine(bundle, config, render_audio=render_audio)
    engine.voices.add(default_voice(bundle))
    return engine


__all__ = ["DEFAULT_VOICE_ID", "EngineConfig", "Priority", "build_engine", "default_voice"]
