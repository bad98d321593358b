"""What a context's segment boundaries cost as a client hears them: request a seeded turn of 1, 2 or 5 segments in
some output format over a vendor's HTTP endpoint or WebSocket, decode what came back (PyAV for every container,
numpy for raw PCM and G.711) and find each segment of the engine's audio in it.

The truth is the FakeEngine's audio for each segment (a pure function of its text and seed, also for a segment the
phrase cache replayed), resampled once, whole, to the output rate. Each segment's start is found in the decoded
audio by normalised cross-correlation with its first `TEMPLATE_S`; the excess at a boundary is how much later the
next segment starts than where the previous one ends (0 for a gapless stream, the silence a drain put there
otherwise). Used by tests/agent_server/protocols/test_gapless.py (the bound) and scripts/bench_boundaries.py (the
table in docs/compatibility.md).
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import av
import httpx
import numpy as np
import orjson
import soxr
from numpy.typing import NDArray
from websockets.asyncio.client import connect

from agent_server.audio.codecs import StreamFormat
from agent_server.audio.formats import alaw_to_pcm16, mulaw_to_pcm16
from agent_server.protocols.vendor_formats import cartesia_format, elevenlabs_format, openai_format
from synth.api import OUTPUT_SAMPLE_RATE_HZ

from tests.agent_server.fake_engine import FakeEngine

# Each sentence is its own segment: the first ends at its full stop (the first segment is cut at a sentence end,
# any length), the others are long enough (>= the segmenter's min_chars) to stand alone.
SENTENCES = (
    "The sky is blue today.",
    "Rivers run down to the sea at dawn.",
    "Birds sing in the tall green trees.",
    "We walk along the quiet road home.",
    "Night falls and the stars come out.",
)
ELEVENLABS_VOICE = "JBFqnCBsd6RMkjVDRZzb"
TEMPLATE_S = 0.25  # how much of a segment's start is looked for
SEARCH_BEFORE_S = 0.03  # where a segment's start is looked for: from this much before where it should be ...
SEARCH_AFTER_S = 1.0  # ... to this much after
FIRST_SEARCH_S = 0.5  # the first segment: within this much of the stream's start (a codec's lead)
PYAV_DEMUXERS = {"mp3": "mp3", "ogg": "ogg", "webm": "webm", "adts": "aac", "flac": "flac", "wav": "wav"}


@dataclass(frozen=True)
class Case:
    """One output format over one endpoint. `name` is the format as that vendor spells it."""

    vendor: str  # elevenlabs | openai | cartesia | deepgram
    transport: str  # http | ws
    name: str
    fmt: StreamFormat

    @property
    def id(self) -> str:
        return f"{self.vendor}-{self.transport}-{self.name}"

    def __str__(self) -> str:
        return self.id


def elevenlabs(name: str, transport: str) -> Case:
    return Case("elevenlabs", transport, name, elevenlabs_format(name))


def openai(name: str) -> Case:
    return Case("openai", "http", name, openai_format(name))


def cartesia(container: str, rate_hz: int, bit_rate: int) -> Case:
    spec = {"container": container, "sample_rate": rate_hz, "bit_rate": bit_rate}
    return Case("cartesia", "http", f"{container}_{rate_hz}_{bit_rate // 1000}", cartesia_format(spec, required=True))


def deepgram(encoding: str, rate_hz: int) -> Case:
    container = {"mp3": "mp3", "aac": "adts", "flac": "flac"}[encoding]
    bitrate = {"mp3": 48_000, "aac": 48_000}.get(encoding)
    return Case("deepgram", "http", f"{encoding}_{rate_hz}", StreamFormat(container, encoding, rate_hz, bitrate))  # type: ignore[arg-type]


ELEVENLABS_NAMES = (
    "mp3_22050_32", "mp3_24000_48", "mp3_44100_32", "mp3_44100_64", "mp3_44100_96", "mp3_44100_128", "mp3_44100_192",
    "opus_48000_32", "opus_48000_192",
    "pcm_8000", "pcm_16000", "pcm_22050", "pcm_24000", "pcm_32000", "pcm_44100", "pcm_48000",
    "wav_8000", "wav_44100", "ulaw_8000", "alaw_8000",
)
# Every format and rate served, each over HTTP and (where a vendor streams it on a WebSocket) over one.
CASES: tuple[Case, ...] = (
    *(elevenlabs(name, "http") for name in ELEVENLABS_NAMES),
    *(elevenlabs(name, "ws") for name in ELEVENLABS_NAMES),
    *(openai(name) for name in ("mp3", "opus", "aac", "flac", "wav", "pcm")),
    cartesia("mp3", 8_000, 32_000), cartesia("mp3", 16_000, 128_000), cartesia("mp3", 48_000, 192_000),
    deepgram("mp3", 22_050), deepgram("aac", 22_050), deepgram("flac", 48_000),
)


@dataclass(frozen=True)
class Heard:
    """One turn as the client decoded it, against the engine's audio."""

    case: Case
    segments: int
    rate_hz: int
    starts_ms: tuple[float, ...]  # where each segment starts in the decoded audio
    lengths_ms: tuple[float, ...]  # each segment's length (the engine's audio, at the output rate)
    matches: tuple[float, ...]  # each segment's correlation with the engine's audio at that start (1: the same)
    decoded_ms: float  # all of the decoded audio

    @property
    def excess_ms(self) -> list[float]:
        """Per boundary: how much later the next segment starts than the previous one ends."""
        return [self.starts_ms[k] - (self.starts_ms[k - 1] + self.lengths_ms[k - 1]) for k in range(1, self.segments)]

    @property
    def lead_ms(self) -> float:
        return self.starts_ms[0]

    @property
    def tail_ms(self) -> float:
        """Decoded audio after the last segment's end."""
        return self.decoded_ms - (self.starts_ms[-1] + self.lengths_ms[-1])


def turn_text(segments: int) -> str:
    return " ".join(SENTENCES[:segments])


def engine_pcm(segments: int, seed: int) -> list[NDArray[Any]]:
    """The FakeEngine's audio of each segment of the turn (segment k is said with seed + k)."""
    return [FakeEngine.expected_pcm(SENTENCES[k], seed + k) for k in range(segments)]


async def request(base_url: str, case: Case, text: str, seed: int) -> bytes:
    """The encoded audio of one turn, as the endpoint sent it."""
    if case.transport == "ws":
        return await _elevenlabs_ws(base_url, case.name, text, seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as http:
        if case.vendor == "elevenlabs":
            response = await http.post(f"/v1/text-to-speech/{ELEVENLABS_VOICE}/stream",
                                       params={"output_format": case.name}, json={"text": text, "seed": seed})
        elif case.vendor == "openai":
            response = await http.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", "input": text,
                                                                  "response_format": case.name, "seed": seed})
        elif case.vendor == "cartesia":
            container, rate, kbps = case.name.split("_")
            response = await http.post("/tts/bytes", json={
                "model_id": "sonic-2", "transcript": text, "voice": {"mode": "id", "id": "default"}, "seed": seed,
                "output_format": {"container": container, "sample_rate": int(rate), "bit_rate": int(kbps) * 1000}})
        else:
            encoding, rate = case.name.split("_")
            response = await http.post("/v1/speak", params={"encoding": encoding, "sample_rate": rate, "seed": seed},
                                       json={"text": text})
        response.raise_for_status()
        return response.content


async def _elevenlabs_ws(base_url: str, output_format: str, text: str, seed: int) -> bytes:
    url = base_url.replace("http", "ws", 1)
    url += f"/v1/text-to-speech/{ELEVENLABS_VOICE}/stream-input?output_format={output_format}&seed={seed}"
    audio = bytearray()
    async with connect(url, max_size=None) as ws:
        await ws.send(orjson.dumps({"text": " "}).decode())
        await ws.send(orjson.dumps({"text": text + " ", "try_trigger_generation": True}).decode())
        await ws.send(orjson.dumps({"text": ""}).decode())
        async for raw in ws:
            message = orjson.loads(raw)
            if message.get("audio"):
                audio += base64.b64decode(message["audio"])
    return bytes(audio)


def decode(data: bytes, fmt: StreamFormat) -> tuple[NDArray[np.float64], int]:
    """Mono float in [-1, 1], and its rate (the format's; Opus decodes at 48 kHz)."""
    if fmt.container == "raw":
        if fmt.codec == "pcm_s16le":
            pcm16 = np.frombuffer(data, dtype="<i2")
        elif fmt.codec == "mulaw":
            pcm16 = mulaw_to_pcm16(np.frombuffer(data, dtype=np.uint8))
        elif fmt.codec == "alaw":
            pcm16 = alaw_to_pcm16(np.frombuffer(data, dtype=np.uint8))
        else:
            return np.frombuffer(data, dtype="<f4").astype(np.float64), fmt.sample_rate_hz
        return pcm16.astype(np.float64) / 32768.0, fmt.sample_rate_hz
    with av.open(io.BytesIO(data), "r", format=PYAV_DEMUXERS[fmt.container]) as container:
        stream = container.streams.audio[0]
        rate = stream.rate
        pieces = []
        for frame in container.decode(stream):
            samples: NDArray[Any] = frame.to_ndarray()
            full_scale = float(np.iinfo(samples.dtype).max + 1) if samples.dtype.kind == "i" else 1.0
            pieces.append(np.asarray(samples, dtype=np.float64).reshape(-1) / full_scale)
    return (np.concatenate(pieces) if pieces else np.zeros(0)), rate


def locate(heard: NDArray[Any], template: NDArray[Any], lo: int, hi: int) -> tuple[int, float]:
    """Where `template` starts in heard[lo:hi + len(template)] (normalised cross-correlation), and how well it
    matches there (1: exactly, up to a gain)."""
    lo = max(0, lo)
    window = heard[lo : hi + template.size]
    if window.size < template.size:
        return lo, 0.0
    n = window.size + template.size
    spectrum = np.fft.rfft(window, n) * np.conj(np.fft.rfft(template, n))
    scores = np.fft.irfft(spectrum, n)[: window.size - template.size + 1]  # correlation at each lag
    squares = np.concatenate(([0.0], np.cumsum(window**2)))
    energy = squares[template.size :] - squares[: -template.size]
    norm = np.sqrt(np.maximum(energy, 1e-12) * float(template @ template))
    scores = scores / norm
    best = int(np.argmax(scores))
    return lo + best, float(scores[best])


def hear(case: Case, data: bytes, pcm_24k: Sequence[NDArray[Any]]) -> Heard:
    """Find each segment of the engine's audio in what the client decoded."""
    heard, rate = decode(data, case.fmt)
    whole = soxr.resample(np.concatenate(pcm_24k).astype(np.float64), OUTPUT_SAMPLE_RATE_HZ, rate, quality="HQ")
    edges = np.round(np.cumsum([0, *(p.size for p in pcm_24k)]) * rate / OUTPUT_SAMPLE_RATE_HZ).astype(int)
    template_n = round(TEMPLATE_S * rate)
    starts: list[int] = []
    matches: list[float] = []
    for k in range(len(pcm_24k)):
        template = whole[edges[k] : min(edges[k + 1], edges[k] + template_n)]
        if k == 0:
            lo, hi = 0, round(FIRST_SEARCH_S * rate)
        else:
            due = starts[-1] + edges[k] - edges[k - 1]
            lo, hi = due - round(SEARCH_BEFORE_S * rate), due + round(SEARCH_AFTER_S * rate)
        start, match = locate(heard, template, lo, hi)
        starts.append(start)
        matches.append(match)
    ms = 1000.0 / rate
    return Heard(case, len(pcm_24k), rate, tuple(s * ms for s in starts),
                 tuple(float(edges[k + 1] - edges[k]) * ms for k in range(len(pcm_24k))), tuple(matches),
                 heard.size * ms)


async def hear_turn(base_url: str, case: Case, segments: int, seed: int) -> Heard:
    data = await request(base_url, case, turn_text(segments), seed)
    return hear(case, data, engine_pcm(segments, seed))


def run(coro: Any) -> Any:
    return asyncio.run(coro)
