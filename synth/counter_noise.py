"""Counter-based noise: element i of stream k's noise is a pure function of (k's seed, domain, i).

A batched render draws every stream's noise in one set of tensor ops (no per-stream generator, no global RNG,
nothing that a CUDA graph cannot capture), and a stream's noise does not depend on what it is batched with,
on the thread, or on how its audio was cut into chunks: noise is indexed by absolute position (mel frame or
sample) in the stream.

The hash is MurmurHash3's 32-bit finaliser (a bijection with full avalanche) chained over
(seed high word, seed low word, domain) and then the counter, computed in int64 tensors on 32-bit values.
Uniforms take the hash's top 24 bits (exact in float32); normals are Box-Muller over two counters.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
MAX_COUNTER = 2**31  # counters stay below this (a stream's samples x harmonics x 2 is far less)
_FMIX_C1 = 0x85EBCA6B
_FMIX_C2 = 0xC2B2AE35
_UNIFORM_BITS = 24
_GOLDEN = 0x9E3779B9
_SECOND_KEY = 0x5BD1E995

# Domains: independent noise sequences of one stream.
FLOW_NOISE = 1  # the flow-matching starting noise, per (mel frame, bin)
SINE_PHASE = 2  # HiFT's per-call initial harmonic phases, per (call's first mel frame, harmonic)
SINE_NOISE = 3  # HiFT's sine-source additive noise, per (sample, harmonic)


def _mul32(a: torch.Tensor, constant: int) -> torch.Tensor:
    """(a * constant) mod 2**32 for a in [0, 2**32), without overflowing int64."""
    low, high = constant & 0xFFFF, constant >> 16
    return (a * low + (((a * high) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _FMIX_C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _FMIX_C2)
    return h ^ (h >> 16)


def stream_keys(seeds: torch.Tensor, domain: int) -> torch.Tensor:
    """seeds [B] int64 in [0, 2**63) -> per-stream 32-bit keys [B] of one domain."""
    high = (seeds >> 32) & MASK32
    low = seeds & MASK32
    return _fmix32((_fmix32(_fmix32(high ^ domain) ^ low) + _GOLDEN) & MASK32)


def _hash(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys broadcastable against counters (int64 in [0, MAX_COUNTER)) -> 32-bit hashes.

    The key enters twice, before and after the first mixing, so two streams' sequences are not relabellings
    of each other's counters (as they would be with fmix(key ^ counter) alone).
    """
    return _fmix32(_fmix32(keys ^ counters) ^ _fmix32(keys ^ _SECOND_KEY))


def uniform(keys: torch.Tensor, counters: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform in (0, 1), shaped like the broadcast of keys and counters."""
    bits: torch.Tensor = _hash(keys, counters) >> (32 - _UNIFORM_BITS)
    draws: torch.Tensor = (bits.to(dtype) + 0.5) * (1.0 / 2**_UNIFORM_BITS)
    return draws


def normal_run(keys: torch.Tensor, first: torch.Tensor, length: int, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Standard normals [B, length] of counters first_b .. first_b + length - 1 (first even, length even).

    Counters 2q and 2q + 1 share one Box-Muller draw from uniforms (2q, 2q + 1): z[2q] = r cos, z[2q + 1] = r sin,
    so every counter's value is fixed whatever run it is drawn in.
    """
    if length % 2:
        raise ValueError("normal runs have an even length")
    pairs = (first[:, None] // 2) + torch.arange(length // 2, device=first.device)[None, :]  # [B, length / 2]
    keys = keys[:, None]
    radius = torch.sqrt(-2.0 * torch.log(uniform(keys, 2 * pairs)))
    angle = (2.0 * math.pi) * uniform(keys, 2 * pairs + 1)
    z = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=2)  # [B, length / 2, 2]
    return z.reshape(first.shape[0], length).to(dtype)
