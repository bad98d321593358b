"""Every vendor's audio format names -> `codecs.StreamFormat`. Pure: no sockets, no awaits.

One parser per vendor field set, used by that vendor's WebSocket and HTTP endpoints alike. Each raises
`FieldError(field, message)`; the vendor's module renders it in the vendor's error shape.

- OpenAI `response_format`: mp3, opus, aac, flac, wav, pcm (all 24 kHz); default mp3.
- ElevenLabs `output_format`: mp3_<rate>_<kbps>, opus_48000_<kbps>, pcm_<rate>, wav_<rate>, ulaw_8000,
  alaw_8000; default mp3_44100_128 (HTTP, WebSocket and the SDKs).
- Cartesia `output_format`: {container: raw | wav | mp3, encoding, sample_rate, bit_rate}; required over
  HTTP, raw pcm_s16le at 24 kHz when the WebSocket leaves it out.
- Deepgram `encoding`, `container`, `sample_rate`, `bit_rate` query parameters; REST: linear16 in WAV at
  24 kHz; WebSocket: linear16 at 24 kHz, no container (linear16, mulaw, alaw only).

Where a vendor documents a bit rate our codec cannot reach at that sample rate (Cartesia mp3 at 8 kHz and
192 kbit/s, Deepgram Opus at 4 kbit/s), the nearest one it can is used (`codecs.clamp_bitrate_bps`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from agent_server.audio.codecs import Codec, Container, StreamFormat, clamp_bitrate_bps
from agent_server.errors import FieldError
from agent_server.protocols.common import is_decimal

BITS_PER_KBIT = 1_000

# ---- OpenAI ------------------------------------------------------------------------------------------

OPENAI_SAMPLE_RATE_HZ = 24_000  # every OpenAI speech format is 24 kHz mono
OPENAI_DEFAULT_FORMAT = "mp3"
OPENAI_MP3_BITRATE_BPS = 64_000
OPENAI_FORMATS: Mapping[str, tuple[Container, Codec, int | None]] = {
    "mp3": ("mp3", "mp3", OPENAI_MP3_BITRATE_BPS),
    "opus": ("ogg", "opus", None),
    "aac": ("adts", "aac", None),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
    "pcm": ("raw", "pcm_s16le", None),
}


def openai_format(response_format: object) -> StreamFormat:
    """OpenAI `response_format` (absent: mp3, the SDK's and the API's default)."""
    name = OPENAI_DEFAULT_FORMAT if response_format is None else response_format
    if not isinstance(name, str) or name not in OPENAI_FORMATS:
        raise FieldError("response_format", f"response_format must be one of {', '.join(OPENAI_FORMATS)}")
    container, codec, bitrate_bps = OPENAI_FORMATS[name]
    return StreamFormat(container, codec, OPENAI_SAMPLE_RATE_HZ, bitrate_bps)


# ---- ElevenLabs --------------------------------------------------------------------------------------

ELEVENLABS_DEFAULT_FORMAT = "mp3_44100_128"
ELEVENLABS_MP3_FORMATS = frozenset(
    {"mp3_22050_32", "mp3_24000_48", "mp3_44100_32", "mp3_44100_64", "mp3_44100_96", "mp3_44100_128", "mp3_44100_192"}
)
ELEVENLABS_OPUS_KBPS = (32, 64, 96, 128, 192)
ELEVENLABS_OPUS_RATE_HZ = 48_000
ELEVENLABS_PCM_RATES_HZ = (8_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
ELEVENLABS_G711_RATE_HZ = 8_000
_ELEVENLABS = re.compile(r"^(mp3|opus|pcm|wav|ulaw|alaw)_(\d+)(?:_(\d+))?$")


def elevenlabs_formats() -> list[str]:
    """Every output_format name served, as the SDK spells them."""
    names = sorted(ELEVENLABS_MP3_FORMATS)
    names += [f"opus_{ELEVENLABS_OPUS_RATE_HZ}_{kbps}" for kbps in ELEVENLABS_OPUS_KBPS]
    names += [f"{kind}_{rate}" for kind in ("pcm", "wav") for rate in ELEVENLABS_PCM_RATES_HZ]
    return [*names, f"ulaw_{ELEVENLABS_G711_RATE_HZ}", f"alaw_{ELEVENLABS_G711_RATE_HZ}"]


def elevenlabs_format(value: str | None, default: str | None = ELEVENLABS_DEFAULT_FORMAT) -> StreamFormat:
    """ElevenLabs `output_format` (absent: `default`; None there makes the field required)."""
    name = value or default
    if not name:
        raise FieldError("output_format", "output_format is required")
    match = _ELEVENLABS.match(name)
    if match is None:
        raise _elevenlabs_unknown(name)
    kind, rate_s, kbps_s = match.groups()
    rate = int(rate_s)
    if kind == "mp3":
        if name not in ELEVENLABS_MP3_FORMATS:
            raise _elevenlabs_unknown(name)
        return StreamFormat("mp3", "mp3", rate, int(kbps_s) * BITS_PER_KBIT)
    if kind == "opus":
        if rate != ELEVENLABS_OPUS_RATE_HZ or kbps_s is None or int(kbps_s) not in ELEVENLABS_OPUS_KBPS:
            raise _elevenlabs_unknown(name)
        return StreamFormat("ogg", "opus", rate, int(kbps_s) * BITS_PER_KBIT)
    if kbps_s is not None:
        raise _elevenlabs_unknown(name)
    if kind in ("pcm", "wav"):
        if rate not in ELEVENLABS_PCM_RATES_HZ:
            raise _elevenlabs_unknown(name)
        return StreamFormat("raw" if kind == "pcm" else "wav", "pcm_s16le", rate)
    if rate != ELEVENLABS_G711_RATE_HZ:
        raise _elevenlabs_unknown(name)
    return StreamFormat("raw", "mulaw" if kind == "ulaw" else "alaw", rate)


def _elevenlabs_unknown(name: str) -> FieldError:
    served = ", ".join(elevenlabs_formats())
    return FieldError("output_format", f"unsupported output_format {name!r}: use one of {served}")


# ---- Cartesia ----------------------------------------------------------------------------------------

CARTESIA_ENCODINGS: Mapping[str, Codec] = {
    "pcm_s16le": "pcm_s16le",
    "pcm_f32le": "pcm_f32le",
    "pcm_mulaw": "mulaw",
    "pcm_alaw": "alaw",
}
CARTESIA_SAMPLE_RATES_HZ = (8_000, 16_000, 22_050, 24_000, 44_100, 48_000)
CARTESIA_MP3_BITRATES_BPS = (32_000, 64_000, 96_000, 128_000, 192_000)
CARTESIA_DEFAULT = StreamFormat("raw", "pcm_s16le", 24_000)
CARTESIA_FORMAT_FIELDS = frozenset({"container", "encoding", "sample_rate", "bit_rate"})


def cartesia_format(value: object, *, required: bool) -> StreamFormat:
    """Cartesia `output_format` object. The WebSocket may leave it out (raw PCM16 at 24 kHz); the HTTP
    endpoints require it, as the API does."""
    if value is None:
        if required:
            raise FieldError("output_format", "output_format is required")
        return CARTESIA_DEFAULT
    if not isinstance(value, dict):
        raise FieldError("output_format", "output_format must be an object")
    unknown = sorted(set(value) - CARTESIA_FORMAT_FIELDS)
    if unknown:
        raise FieldError(f"output_format.{unknown[0]}", f"unknown field output_format.{unknown[0]}")
    container = value.get("container", "raw")
    rate = value.get("sample_rate", CARTESIA_DEFAULT.sample_rate_hz)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in CARTESIA_SAMPLE_RATES_HZ:
        allowed = ", ".join(str(r) for r in CARTESIA_SAMPLE_RATES_HZ)
        raise FieldError("output_format.sample_rate", f"sample_rate must be one of {allowed} (got {rate!r})")
    if container == "mp3":
        bit_rate = value.get("bit_rate")
        if bit_rate not in CARTESIA_MP3_BITRATES_BPS or isinstance(bit_rate, bool):
            allowed = ", ".join(str(b) for b in CARTESIA_MP3_BITRATES_BPS)
            raise FieldError("output_format.bit_rate", f"an mp3 output_format needs bit_rate, one of {allowed}")
        return StreamFormat("mp3", "mp3", rate, clamp_bitrate_bps("mp3", rate, int(bit_rate)))
    if container not in ("raw", "wav"):
        raise FieldError("output_format.container", f"container must be raw, wav or mp3 (got {container!r})")
    if value.get("bit_rate") is not None:
        raise FieldError("output_format.bit_rate", f"bit_rate is for mp3 only, not {container}")
    encoding = value.get("encoding", "pcm_s16le")
    if not isinstance(encoding, str) or encoding not in CARTESIA_ENCODINGS:
        served = ", ".join(CARTESIA_ENCODINGS)
        raise FieldError("output_format.encoding", f"encoding must be one of {served} (got {encoding!r})")
    codec = CARTESIA_ENCODINGS[encoding]
    try:
        return StreamFormat(container, codec, rate)
    except ValueError as exc:  # mu-law / A-law at a rate other than 8 kHz
        raise FieldError("output_format.sample_rate", str(exc).split(": ", 1)[-1]) from None


# ---- Deepgram ----------------------------------------------------------------------------------------

# encoding -> (default container, allowed containers, sample rates (first: default), bit rates (default, min, max))
DEEPGRAM_ENCODINGS: Mapping[str, tuple[str, tuple[str, ...], tuple[int, ...], tuple[int, int, int] | None]] = {
    "linear16": ("wav", ("wav", "none"), (24_000, 8_000, 16_000, 32_000, 48_000), None),
    "mulaw": ("wav", ("wav", "none"), (8_000,), None),
    "alaw": ("wav", ("wav", "none"), (8_000,), None),
    "mp3": ("none", ("none",), (22_050,), (48_000, 32_000, 48_000)),
    "opus": ("ogg", ("ogg",), (48_000,), (12_000, 4_000, 650_000)),
    "flac": ("none", ("none",), (48_000, 8_000, 16_000, 22_050, 32_000), None),
    "aac": ("none", ("none",), (22_050,), (48_000, 4_000, 192_000)),
}
DEEPGRAM_CODECS: Mapping[str, tuple[Container, Codec]] = {
    "linear16": ("raw", "pcm_s16le"),
    "mulaw": ("raw", "mulaw"),
    "alaw": ("raw", "alaw"),
    "mp3": ("mp3", "mp3"),
    "opus": ("ogg", "opus"),
    "flac": ("flac", "flac"),
    "aac": ("adts", "aac"),
}
DEEPGRAM_STREAMING_ENCODINGS = ("linear16", "mulaw", "alaw")


def deepgram_format(params: Mapping[str, str], *, rest: bool) -> StreamFormat:
    """Deepgram `encoding`, `container`, `sample_rate`, `bit_rate` query parameters. REST defaults to
    linear16 in a WAV container; the WebSocket to raw linear16 and takes linear16/mulaw/alaw only."""
    encoding = params.get("encoding") or "linear16"
    if encoding not in DEEPGRAM_ENCODINGS:
        raise FieldError("encoding", f"encoding must be one of {', '.join(DEEPGRAM_ENCODINGS)} (got {encoding!r})")
    if not rest and encoding not in DEEPGRAM_STREAMING_ENCODINGS:
        served = ", ".join(DEEPGRAM_STREAMING_ENCODINGS)
        raise FieldError("encoding", f"the WebSocket serves {served} (got {encoding!r})")
    default_container, containers, rates, bitrates = DEEPGRAM_ENCODINGS[encoding]
    if not rest:
        default_container, containers = "none", ("none",)
    container = params.get("container") or default_container
    if container not in containers:
        raise FieldError("container", f"{encoding} comes in container {' or '.join(containers)} (got {container!r})")
    rate = _positive_int(params, "sample_rate", rates[0])
    if rate not in rates:
        served = ", ".join(str(r) for r in sorted(rates))
        raise FieldError("sample_rate", f"{encoding} is served at {served} Hz (got {rate})")
    bitrate_bps: int | None = None
    raw_bitrate = params.get("bit_rate")
    if bitrates is None:
        if raw_bitrate:
            raise FieldError("bit_rate", f"bit_rate does not apply to {encoding}")
    else:
        default_bps, low_bps, high_bps = bitrates
        bitrate_bps = _positive_int(params, "bit_rate", default_bps)
        if not low_bps <= bitrate_bps <= high_bps:
            raise FieldError("bit_rate", f"bit_rate for {encoding} is {low_bps}..{high_bps} (got {bitrate_bps})")
    out_container, codec = DEEPGRAM_CODECS[encoding]
    if out_container == "raw" and container == "wav":
        out_container = "wav"
    return StreamFormat(out_container, codec, rate, clamp_bitrate_bps(codec, rate, bitrate_bps))


def _positive_int(params: Mapping[str, str], name: str, default: int) -> int:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    value = raw.removesuffix(".0")  # the SDK sends floats (24000.0)
    if not is_decimal(value) or int(value) <= 0:
        raise FieldError(name, f"{name} must be a positive integer (got {raw!r})")
    return int(value)
