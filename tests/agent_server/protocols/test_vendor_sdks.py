"""Each vendor's own SDK, its defaults unchanged (no format argument), against a real server
(tests/agent_server/live_server.py) with the FakeEngine behind it: OpenAI `audio.speech.create` and
`with_streaming_response`, ElevenLabs `text_to_speech.convert`, `.stream`, `.convert_with_timestamps` and
`.stream_with_timestamps`, Cartesia `tts.bytes` and `tts.sse` (their required arguments only), Deepgram's
`speak.v1.audio.generate`. Each answer is decoded with PyAV and its duration compared with the audio the
engine made for the request (`assert_decoded_duration` states the tolerance)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import av
import httpx
import numpy as np
import pytest

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

TEXT = "Sure, I can help with that. Your flight leaves at nine fifteen tomorrow morning."
VOICE = "JBFqnCBsd6RMkjVDRZzb"
# What an encoder may add to the engine's audio: at each segment's end a drain (when the next segment is not
# there yet) completes the codec frame and feeds the frames that get the codec's held-back audio out
# (PCM: the resampler's tail, a few ms; MP3 at 44.1 kHz: up to ~0.12 s), and MP3/AAC streams decode with
# the encoder's priming and the last frame's padding (under 0.1 s).
PAD_PER_SEGMENT_S = 0.15
PRIMING_AND_LAST_FRAME_S = 0.1
# What decoding may lose at the end (resampling to the codec's rate rounds the last samples).
SHORT_BY_S = 0.002


def decode(data: bytes) -> tuple[str, int, float]:
    """(codec, sample rate, seconds) of an encoded stream, decoded by PyAV."""
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return stream.codec_context.name, stream.rate, samples / stream.rate


def engine_seconds(served: Served) -> tuple[float, int]:
    """(seconds of audio the engine made for everything asked so far, segments)."""
    samples_24k, segments = served.produced()
    return samples_24k / 24_000, segments


def assert_decoded_duration(served: Served, decoded_s: float) -> None:
    made_s, segments = engine_seconds(served)
    assert made_s > 0
    assert made_s - SHORT_BY_S <= decoded_s <= made_s + segments * PAD_PER_SEGMENT_S + PRIMING_AND_LAST_FRAME_S, (
        decoded_s, made_s, segments)


# ---- OpenAI ----------------------------------------------------------------------------------------


def openai_client(served: Served) -> Any:
    import openai

    return openai.OpenAI(api_key="sk-test", base_url=served.http + "/v1", max_retries=0)


def test_openai_create_with_defaults_is_mp3(served: Served) -> None:
    with openai_client(served) as client:
        response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT)
        assert response.response.headers["content-type"] == "audio/mpeg"
        audio = response.content
    codec, rate_hz, seconds = decode(audio)
    assert codec in ("mp3", "mp3float") and rate_hz == 24_000
    assert_decoded_duration(served, seconds)


def test_openai_with_streaming_response_defaults(served: Served) -> None:
    with openai_client(served) as client, client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TEXT
    ) as response:
        pieces = list(response.iter_bytes())
    codec, _, seconds = decode(b"".join(pieces))
    assert codec in ("mp3", "mp3float")
    assert_decoded_duration(served, seconds)


@pytest.mark.parametrize(("response_format", "codec"), [("opus", "opus"), ("aac", "aac"), ("flac", "flac"),
                                                        ("wav", "pcm_s16le")])
def test_openai_every_format(served: Served, response_format: str, codec: str) -> None:
    with openai_client(served) as client:
        audio = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT,
                                           response_format=response_format).content
    got, _, seconds = decode(audio)
    assert got == codec
    assert_decoded_duration(served, seconds)


# ---- ElevenLabs --------------------------------------------------------------------------------------


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """The HTTP client for SDKs that take one (closed after the test: no socket left open)."""
    with httpx.Client(timeout=30.0) as client:
        yield client


def elevenlabs_client(served: Served, http: httpx.Client) -> Any:
    from elevenlabs.client import ElevenLabs

    return ElevenLabs(api_key="sk-test", base_url=served.http, httpx_client=http)


def test_elevenlabs_convert_with_defaults_is_mp3_44100_128(served: Served, http: httpx.Client) -> None:
    audio = b"".join(elevenlabs_client(served, http).text_to_speech.convert(VOICE, text=TEXT))
    codec, rate_hz, seconds = decode(audio)
    assert codec in ("mp3", "mp3float") and rate_hz == 44_100
    assert_decoded_duration(served, seconds)


def test_elevenlabs_stream_with_defaults(served: Served, http: httpx.Client) -> None:
    pieces = list(elevenlabs_client(served, http).text_to_speech.stream(VOICE, text=TEXT))
    codec, _, seconds = decode(b"".join(pieces))
    assert codec in ("mp3", "mp3float")
    assert_decoded_duration(served, seconds)


def test_elevenlabs_convert_with_timestamps_with_defaults(served: Served, http: httpx.Client) -> None:
    result = elevenlabs_client(served, http).text_to_speech.convert_with_timestamps(VOICE, text=TEXT)
    codec, _, seconds = decode(base64.b64decode(result.audio_base_64))
    assert codec in ("mp3", "mp3float")
    assert_decoded_duration(served, seconds)
    alignment = result.alignment
    assert "".join(alignment.characters) == TEXT  # the request's text, segments glued at their spaces
    starts, ends = alignment.character_start_times_seconds, alignment.character_end_times_seconds
    assert starts == sorted(starts) and ends == sorted(ends)
    assert 0.02 < starts[0] < 0.03  # from the start of the audio as decoded: LAME's 1105 samples first
    assert seconds - 0.5 < ends[-1] <= seconds
    assert result.normalized_alignment == alignment


def test_elevenlabs_stream_with_timestamps_with_defaults(served: Served, http: httpx.Client) -> None:
    chunks = list(elevenlabs_client(served, http).text_to_speech.stream_with_timestamps(VOICE, text=TEXT))
    audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks)
    _, _, seconds = decode(audio)
    assert_decoded_duration(served, seconds)
    aligned = [c.alignment for c in chunks if c.alignment is not None]
    assert len(aligned) == engine_seconds(served)[1]  # one per segment, after its audio
    assert "".join("".join(a.characters) for a in aligned).split() == TEXT.split()
    starts = [t for a in aligned for t in a.character_start_times_seconds]
    assert starts == sorted(starts) and starts[-1] < seconds  # from the request's start, never restarting


# ---- Cartesia ----------------------------------------------------------------------------------------


def cartesia_client(served: Served) -> Any:
    from cartesia import Cartesia

    return Cartesia(api_key="sk-test", base_url=served.http, max_retries=0)


MP3_44K = {"container": "mp3", "sample_rate": 44_100, "bit_rate": 128_000}
WAV_16K = {"container": "wav", "encoding": "pcm_s16le", "sample_rate": 16_000}


@pytest.mark.parametrize(("output_format", "codec"), [(MP3_44K, "mp3"), (WAV_16K, "pcm_s16le")])
def test_cartesia_bytes(served: Served, output_format: dict[str, Any], codec: str) -> None:
    with cartesia_client(served) as client:
        audio = b"".join(client.tts.bytes(model_id="sonic-2", transcript=TEXT, voice={"mode": "id", "id": "a0e9"},
                                          output_format=output_format))
    got, _, seconds = decode(audio)
    assert got.startswith(codec)
    assert_decoded_duration(served, seconds)


def test_cartesia_sse_with_word_timestamps(served: Served) -> None:
    with cartesia_client(served) as client:
        events = list(client.tts.sse(
            model_id="sonic-2", transcript=TEXT, voice={"mode": "id", "id": "a0e9"}, add_timestamps=True,
            output_format={"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16_000},
        ))
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and "chunk" in kinds and "timestamps" in kinds
    audio = np.concatenate([np.frombuffer(base64.b64decode(e.data), "<f4") for e in events if e.type == "chunk"])
    seconds = len(audio) / 16_000
    assert_decoded_duration(served, seconds)
    words = [w for e in events if e.type == "timestamps" for w in e.word_timestamps.words]
    starts = [t for e in events if e.type == "timestamps" for t in e.word_timestamps.start]
    assert words == TEXT.split() and starts == sorted(starts) and starts[-1] < seconds


# ---- Deepgram ----------------------------------------------------------------------------------------


def deepgram_client(served: Served, http: httpx.Client) -> Any:
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    env = DeepgramClientEnvironment(base=served.http, production=served.ws, agent=served.ws, agent_rest=served.http)
    return DeepgramClient(api_key="dg-test", environment=env, httpx_client=http)


def test_deepgram_generate_with_defaults_is_wav(served: Served, http: httpx.Client) -> None:
    audio = b"".join(deepgram_client(served, http).speak.v1.audio.generate(text=TEXT))
    codec, rate_hz, seconds = decode(audio)
    assert (codec, rate_hz) == ("pcm_s16le", 24_000)
    assert_decoded_duration(served, seconds)


@pytest.mark.parametrize("encoding", ["mp3", "opus", "aac", "flac"])
def test_deepgram_generate_compressed(served: Served, http: httpx.Client, encoding: str) -> None:
    audio = b"".join(deepgram_client(served, http).speak.v1.audio.generate(text=TEXT, encoding=encoding))
    codec, _, seconds = decode(audio)
    assert codec.startswith(encoding)
    assert_decoded_duration(served, seconds)


def test_the_engine_made_what_was_asked(served: Served, http: httpx.Client) -> None:
    """The duration checks compare with the FakeEngine's own account of what it made: it made audio for
    every segment of the text, nothing else."""
    b"".join(deepgram_client(served, http).speak.v1.audio.generate(text=TEXT))
    texts = [r.text for r in served.engine.submits]
    assert " ".join(texts).split() == TEXT.split()
    assert served.produced()[0] == sum(
        len(FakeEngine.expected_tokens(r.text, served.engine.seed_of(r.request_id))) * 960
        for r in served.engine.submits)
