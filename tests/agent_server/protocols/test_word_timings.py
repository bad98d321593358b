"""Word timings over several segments, as each client computes them with its defaults, against where each
segment's audio really is in the stream that client received (found by cross-correlating the received
audio with the FakeEngine's own audio of that segment).

The ElevenLabs WebSocket carries both time bases (protocols/elevenlabs.py): LiveKit's plugin reads
`normalizedAlignment` (times from the context's start), Pipecat's service reads `alignment` (times from
each message's start, which it adds up). Both must put every segment's first word where its audio starts,
never restarting at a segment; so must the Cartesia WebSocket's `timestamps` (LiveKit's Cartesia plugin)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
import soxr
from numpy.typing import NDArray

pytest.importorskip("livekit.agents")
pytest.importorskip("pipecat")

from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import cartesia as lk_cartesia
from livekit.plugins import elevenlabs as lk_elevenlabs
from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame, TTSAudioRawFrame
from pipecat.pipeline.worker import PipelineParams
from pipecat.services.elevenlabs.dialogue.tts import ElevenLabsDialogueTTSService
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.tests.utils import SleepFrame, run_test
from websockets.asyncio.client import connect

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(90)

RATE_HZ = 16_000
PIECES = ["Sure, I can ", "help with that. ", "Your flight leaves ", "at nine tomorrow. ", "It is ",
          "on time today. ", "Have a good trip and a pleasant flight. ", "We will see you at the gate soon. "]
SEGMENTS = 5  # what the segmenter makes of PIECES (issue 35: timestamps checked at 5 segments)
WORDS = "".join(PIECES).split()
TOLERANCE_S = 0.004  # ms rounding of the alignment, and a sample or two of the correlation


def segment_starts_s(served: Served, received: bytes, rate_hz: int) -> list[tuple[str, float]]:
    """(segment text, where its first sample is in `received` (PCM16 at `rate_hz`), s), for every segment."""
    heard = np.frombuffer(received, "<i2").astype(np.float64) / 32768.0
    out = []
    for request in served.engine.submits:
        pcm_24k = FakeEngine.expected_pcm(request.text, served.engine.seed_of(request.request_id))
        reference = soxr.resample(pcm_24k.astype(np.float64), 24_000, rate_hz)
        out.append((request.text, best_offset(heard, reference) / rate_hz))
    return out


def best_offset(signal: NDArray[np.float64], reference: NDArray[np.float64]) -> int:
    """Where `reference` lies in `signal` (the lag of the cross-correlation's peak, FFT-computed)."""
    n = len(signal) + len(reference)
    spectrum = np.fft.rfft(signal, n) * np.conj(np.fft.rfft(reference, n))
    correlation = np.fft.irfft(spectrum, n)[: len(signal) - len(reference) + 1]  # lags 0 .. the last full overlap
    return int(np.argmax(correlation))


def assert_words_on_the_audio(served: Served, received: bytes, words: list[tuple[str, float]],
                              rate_hz: int = RATE_HZ) -> None:
    """Each segment's first word starts where the segment's audio does; all others lie inside their segment's
    audio; the times never go back, nor drift from one segment to the next."""
    starts = segment_starts_s(served, received, rate_hz)
    assert len(starts) >= SEGMENTS, starts
    times = [t for _, t in words]
    assert times == sorted(times), words
    i = 0
    offsets_s = []  # each segment's first word minus where its audio is
    for n, (text, start_s) in enumerate(starts):
        end_s = starts[n + 1][1] if n + 1 < len(starts) else len(received) / 2 / rate_hz
        seg_words = text.split()
        got = words[i:i + len(seg_words)]
        assert [w.strip() for w, _ in got] == seg_words[:len(got)], (got, seg_words)
        offsets_s.append(got[0][1] - start_s)
        assert all(start_s - TOLERANCE_S <= t <= end_s for _, t in got), (text, got, start_s, end_s)
        i += len(seg_words)
    assert i >= len(words)
    assert all(abs(offset_s) <= TOLERANCE_S for offset_s in offsets_s), offsets_s


# ---- LiveKit: ElevenLabs multi-stream-input (normalizedAlignment) and Cartesia ---------------------------


async def livekit_words(served: Served, make: Any) -> tuple[bytes, list[tuple[str, float]]]:
    async with aiohttp.ClientSession() as http:
        tts = make(served, http)
        stream = tts.stream()
        for piece in PIECES:
            stream.push_text(piece)
        stream.end_input()
        audio, words = b"", []
        async for event in stream:
            audio += event.frame.data.tobytes()
            words += [(str(w), float(w.start_time)) for w in event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
        await stream.aclose()
        await tts.aclose()
    return audio, words


def test_livekit_elevenlabs_word_times(served: Served) -> None:
    def make(s: Served, http: aiohttp.ClientSession) -> Any:
        return lk_elevenlabs.TTS(api_key="sk", base_url=s.http + "/v1", encoding="pcm_16000", http_session=http)

    audio, words = asyncio.run(livekit_words(served, make))
    assert_words_on_the_audio(served, audio, words)
    assert len(words) >= len(WORDS) - 1  # LiveKit holds the very last word until more text comes


def test_livekit_elevenlabs_dialogue_word_times(served: Served) -> None:
    """`model="eleven_v3"`: LiveKit speaks text-to-dialogue multi-stream-input, whose alignment is relative to
    each message (it adds each message's audio to its clock): every word must still land on its audio."""
    def make(s: Served, http: aiohttp.ClientSession) -> Any:
        return lk_elevenlabs.TTS(api_key="sk", base_url=s.http + "/v1", model="eleven_v3", encoding="pcm_16000",
                                 http_session=http)

    audio, words = asyncio.run(livekit_words(served, make))
    assert_words_on_the_audio(served, audio, words)
    assert len(words) >= len(WORDS) - 1


# ---- compressed formats: the times against the audio as a standard decoder (ffmpeg, through PyAV) plays it ----


async def elevenlabs_messages(url: str) -> list[dict[str, Any]]:
    """One multi-stream-input context as Pipecat and LiveKit drive it: init, pieces, flush, close_context."""
    messages = []
    async with connect(url) as ws:
        await ws.send(json.dumps({"text": " ", "context_id": "a"}))
        for piece in PIECES:
            await ws.send(json.dumps({"text": piece, "context_id": "a"}))
        await ws.send(json.dumps({"text": "", "context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        async for raw in ws:
            messages.append(json.loads(raw))
            if messages[-1].get("isFinal"):
                return messages
    raise AssertionError("no isFinal")


@pytest.mark.parametrize("output_format", ["mp3_44100_128", "mp3_22050_32", "opus_48000_64"])
def test_compressed_formats_times_are_where_the_decoded_audio_is(served: Served, output_format: str) -> None:
    """MP3 decodes with the encoder's priming first (the times include it); between segments the codec goes on
    (a drain, when the listener runs dry, pads whole codec frames: the times include that too): every segment's
    first character, in both time bases, is where PyAV finds that segment's audio."""
    url = f"{served.ws}/v1/text-to-speech/v/multi-stream-input?output_format={output_format}"
    messages = asyncio.run(elevenlabs_messages(url))
    encoded = b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))
    with av.open(io.BytesIO(encoded), "r") as container:
        stream = container.streams.audio[0]
        rate_hz = stream.rate
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
    pcm16 = (np.clip(decoded, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    aligned = [m for m in messages if m.get("normalizedAlignment")]
    words: list[tuple[str, float]] = []
    message_start_ms = 0
    for m in aligned:
        context, relative = m["normalizedAlignment"], m["alignment"]
        text = "".join(context["chars"])
        starts = context["charStartTimesMs"]
        # the message-relative `alignment`, added up as a client does, gives the same times
        assert [message_start_ms + t for t in relative["charStartTimesMs"]] == starts
        message_start_ms = starts[-1] + context["charDurationsMs"][-1]
        at = 0
        for word in text.split():
            at = text.index(word, at)
            words.append((word, starts[at] / 1000.0))
            at += len(word)
    assert_words_on_the_audio(served, pcm16, words, rate_hz)


async def dialogue_messages(url: str) -> list[dict[str, Any]]:
    """One text-to-dialogue context as LiveKit drives it: registration, pieces, flush, close_context."""
    messages = []
    async with connect(url) as ws:
        await ws.send(json.dumps({"context_id": "a", "voices": ["v"]}))
        for piece in PIECES:
            await ws.send(json.dumps({"context_id": "a", "inputs": [{"text": piece, "voice_id": "v"}]}))
        await ws.send(json.dumps({"context_id": "a", "flush": True}))
        await ws.send(json.dumps({"context_id": "a", "close_context": True}))
        async for raw in ws:
            messages.append(json.loads(raw))
            if messages[-1].get("is_final"):
                return messages
    raise AssertionError("no is_final")


def ogg_end_ms(data: bytes) -> float:
    """The last complete Ogg page's granule position, in ms (how LiveKit counts Opus audio received)."""
    end_ms, pos = 0.0, 0
    while len(data) - pos >= 27:
        header = 27 + data[pos + 26]
        if len(data) - pos < header or len(data) - pos < header + sum(data[pos + 27:pos + header]):
            break
        granule = int.from_bytes(data[pos + 6:pos + 14], "little", signed=True)
        end_ms = granule / 48 if granule > 0 else end_ms
        pos += header + sum(data[pos + 27:pos + header])
    return end_ms


@pytest.mark.parametrize("output_format", ["mp3_22050_32", "mp3_44100_128", "opus_48000_64", "pcm_16000"])
def test_dialogue_times_from_the_bytes_received_are_where_the_decoded_audio_is(served: Served,
                                                                               output_format: str) -> None:
    """Text to dialogue's alignment is relative to the audio received before it, which LiveKit counts from the
    bytes (MP3: size x 8 / bit rate; Opus: the Ogg granule; PCM: its size), not from what went into the codec
    (which holds some back): every segment's first word is where PyAV finds that segment's audio."""
    url = f"{served.ws}/v1/text-to-dialogue/multi-stream-input?output_format={output_format}&sync_alignment=true"
    messages = asyncio.run(dialogue_messages(url))
    encoded, words = b"", []
    codec, rate, *rest = output_format.split("_")
    for message in messages:
        if message.get("audio"):
            encoded += base64.b64decode(message["audio"])
        elif message.get("alignment"):
            if codec == "pcm":
                received_ms = len(encoded) / 2 / int(rate) * 1000
            elif codec == "mp3":
                received_ms = len(encoded) * 8 / int(rest[0])
            else:
                received_ms = ogg_end_ms(encoded)
            aligned = message["alignment"]
            text = "".join(aligned["chars"])
            at = 0
            for word in text.split():
                at = text.index(word, at)
                words.append((word, (received_ms + aligned["char_start_times_ms"][at]) / 1000.0))
                at += len(word)
    if codec == "pcm":
        pcm16, rate_hz = encoded, int(rate)
    else:
        with av.open(io.BytesIO(encoded), "r") as container:
            stream = container.streams.audio[0]
            rate_hz = stream.rate
            decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        pcm16 = (np.clip(decoded, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    assert_words_on_the_audio(served, pcm16, words, rate_hz)


def test_livekit_cartesia_word_times(served: Served) -> None:
    def make(s: Served, http: aiohttp.ClientSession) -> Any:
        return lk_cartesia.TTS(api_key="sk", base_url=s.http, sample_rate=RATE_HZ, http_session=http,
                               word_timestamps=True)

    audio, words = asyncio.run(livekit_words(served, make))
    assert_words_on_the_audio(served, audio, words)
    assert [w.strip() for w, _ in words] == WORDS


# ---- Pipecat: ElevenLabs WebSocket (alignment, message-relative, added up by the service) -----------------


@pytest.mark.parametrize("service_class", [ElevenLabsTTSService, ElevenLabsDialogueTTSService])
def test_pipecat_elevenlabs_word_times(served: Served, service_class: Any) -> None:
    """Pipecat's ElevenLabs services: text to speech (multi-stream-input) and text to dialogue (eleven_v3; its
    clock adds up each alignment message's span, where LiveKit's adds up the audio: both must land)."""
    words: list[tuple[str, float]] = []
    model = "eleven_v3" if service_class is ElevenLabsDialogueTTSService else "eleven_flash_v2_5"

    async def main() -> list[object]:
        service = service_class(
            api_key="sk", url=served.ws, settings=service_class.Settings(voice="JBFqnCBsd6RMkjVDRZzb", model=model))
        consume = service.add_word_timestamps

        async def record(word_times: list[tuple[str, float]], *args: Any, **kwargs: Any) -> None:
            words.extend(word_times)  # what the service computed from our messages, as it hands it on
            await consume(word_times, *args, **kwargs)

        service.add_word_timestamps = record
        frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(p) for p in PIECES], LLMFullResponseEndFrame(),
                  SleepFrame(sleep=2.0)]
        down, _ = await run_test(service, frames_to_send=frames,
                                 pipeline_params=PipelineParams(audio_out_sample_rate=RATE_HZ))
        return list(down)

    down = asyncio.run(main())
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    spoken = [(w, t) for w, t in words if w.strip()]
    assert [w.strip() for w, _ in spoken] == WORDS
    assert_words_on_the_audio(served, audio, spoken)
