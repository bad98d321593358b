"""The vendor HTTP parsers and response shapes (protocols/elevenlabs_http.py, cartesia_http.py,
deepgram_http.py), driven by the vendors' own SDKs with their defaults unchanged, through an in-process
httpx transport: the SDK's real request goes through our parser, our body goes back through the SDK's
own response parsing. Audio is made by our encoders and decoded with PyAV.
"""

from __future__ import annotations

import base64
import io
import uuid
from collections.abc import Callable
from typing import Any

import av
import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.core.stream import char_alignment
from agent_server.errors import FieldError
from agent_server.protocols import cartesia_http, deepgram_http, elevenlabs_http
from agent_server.protocols.http_speech import Base64Stream
from agent_server.text.timestamps import ContextAlignment

VARIANT = Router(DEFAULT_ROUTES, ("english",))  # one model loaded, the built-in table
PCM_S = 1.2
TEXT = "Hello there, friend. How are you?"


def pcm() -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(7)
    return (0.2 * rng.standard_normal(int(24_000 * PCM_S))).astype(np.float32)


def encode(fmt: StreamFormat) -> bytes:
    enc = make_encoder(fmt)
    return b"".join(enc.push(pcm()) + enc.finish())


def decoded_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        return sum(f.samples for f in container.decode(stream)) / stream.rate


def alignment_of(text: str, audio_ms: float) -> ContextAlignment:
    ctx = ContextAlignment()
    starts, durations = char_alignment(text, 0.0, audio_ms)
    ctx.add(text, starts, durations, 0.0, audio_ms, segment_relative=True, boundary_space=False)
    return ctx


def transport(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://test")


# ---- ElevenLabs -----------------------------------------------------------------------------------


def elevenlabs_handler(seen: list[elevenlabs_http.SpeechRequest]) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/v1/text-to-speech/")
        voice_id, _, route = path.partition("/")
        try:
            parsed = elevenlabs_http.parse_request(
                voice_id, dict(request.url.params), orjson.loads(request.content), VARIANT,
                streamed=route.startswith("stream"), timestamps=route.endswith("with-timestamps"),
            )
        except FieldError as exc:
            status, body = elevenlabs_http.error_body(exc)
            return httpx.Response(status, json=body)
        seen.append(parsed)
        audio = encode(parsed.output)
        if not parsed.timestamps:
            return httpx.Response(200, content=audio, headers={"content-type": elevenlabs_http.media_type(parsed)})
        ctx = alignment_of(parsed.text, PCM_S * 1000)
        if route == "with-timestamps":  # the object as the protocol writes it: base64 piece by piece, then the rest
            pieces = Base64Stream()
            written = elevenlabs_http.WITH_TIMESTAMPS_OPEN + b"".join(pieces.push(audio[i:i + 1001])
                                                                      for i in range(0, len(audio), 1001))
            written += pieces.finish() + elevenlabs_http.with_timestamps_close(ctx.chars, ctx.start_ms, ctx.end_ms)
            return httpx.Response(200, content=written, headers={"content-type": "application/json"})
        half = len(audio) // 2
        aligned = elevenlabs_http.alignment(ctx.chars, ctx.start_ms, ctx.end_ms)
        lines = elevenlabs_http.stream_line(audio[:half], None) + elevenlabs_http.stream_line(audio[half:], aligned)
        return httpx.Response(200, content=lines, headers={"content-type": "application/json"})

    return handle


@pytest.fixture
def eleven() -> tuple[Any, list[elevenlabs_http.SpeechRequest]]:
    from elevenlabs import ElevenLabs

    seen: list[elevenlabs_http.SpeechRequest] = []
    return ElevenLabs(api_key="k", base_url="http://test", httpx_client=transport(elevenlabs_handler(seen))), seen


def test_elevenlabs_convert_with_sdk_defaults_gets_mp3(eleven: tuple[Any, list[Any]]) -> None:
    client, seen = eleven
    audio = b"".join(client.text_to_speech.convert("JBFqnCBsd6RMkjVDRZzb", text=TEXT,
                                                   model_id="eleven_multilingual_v2"))
    assert seen[0].output == StreamFormat("mp3", "mp3", 44_100, 128_000) and seen[0].text == TEXT
    assert abs(decoded_seconds(audio) - PCM_S) < 0.1  # LAME priming + last frame padding


def test_elevenlabs_stream_with_a_pcm_format(eleven: tuple[Any, list[Any]]) -> None:
    client, seen = eleven
    audio = b"".join(client.text_to_speech.stream("v", text=TEXT, output_format="pcm_16000", seed=7))
    assert seen[0].streamed and seen[0].seed == 7 and len(audio) == int(PCM_S * 16_000) * 2


def test_elevenlabs_convert_with_timestamps_parses_in_the_sdk(eleven: tuple[Any, list[Any]]) -> None:
    client, _ = eleven
    result = client.text_to_speech.convert_with_timestamps("v", text=TEXT)
    assert abs(decoded_seconds(base64.b64decode(result.audio_base_64)) - PCM_S) < 0.1
    alignment = result.alignment
    assert "".join(alignment.characters) == TEXT
    assert alignment.character_start_times_seconds == sorted(alignment.character_start_times_seconds)
    assert alignment.character_end_times_seconds[-1] == pytest.approx(PCM_S)


def test_elevenlabs_stream_with_timestamps_parses_in_the_sdk(eleven: tuple[Any, list[Any]]) -> None:
    client, _ = eleven
    chunks = list(client.text_to_speech.stream_with_timestamps("v", text=TEXT, output_format="opus_48000_64"))
    assert len(chunks) == 2 and chunks[0].alignment is None
    audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks)
    assert abs(decoded_seconds(audio) - PCM_S) < 0.03
    assert "".join(chunks[1].alignment.characters) == TEXT


def test_elevenlabs_refusal_reaches_the_sdk_as_its_validation_error(eleven: tuple[Any, list[Any]]) -> None:
    from elevenlabs.errors import UnprocessableEntityError

    client, _ = eleven
    with pytest.raises(UnprocessableEntityError) as exc:
        b"".join(client.text_to_speech.convert("v", text=TEXT, output_format="mp3_44100_100"))
    detail = exc.value.body["detail"][0]
    assert detail["loc"] == ["query", "output_format"] and "mp3_44100_128" in detail["msg"]


@pytest.mark.parametrize(("query", "body", "field"), [
    ({}, {"model_id": "x"}, "text"),
    ({}, {"text": "  "}, "text"),
    ({}, {"text": "hi", "stability": 1}, "stability"),
    ({}, {"text": "hi", "voice_settings": "calm"}, "voice_settings"),
    ({}, {"text": "hi", "apply_text_normalization": "maybe"}, "apply_text_normalization"),
    ({}, {"text": "hi", "model_id": "turbo"}, "model_id"),
    ({}, {"text": "hi", "language_code": "fr"}, "language_code"),
    ({}, {"text": "hi", "seed": -1}, "seed"),
    ({"output_format": "flac_44100"}, {"text": "hi"}, "output_format"),
    ({}, [1, 2], "body"),
])
def test_elevenlabs_refusals(query: dict[str, str], body: object, field: str) -> None:
    with pytest.raises(FieldError) as exc:
        elevenlabs_http.parse_request("v", query, body, VARIANT, streamed=False, timestamps=False)
    assert exc.value.field == field
    status, rendered = elevenlabs_http.error_body(exc.value)
    assert status == 422 and rendered["detail"][0]["loc"][1] == field


def test_elevenlabs_accepts_every_documented_body_field() -> None:
    body = {"text": "hi", "model_id": "eleven_flash_v2_5", "language_code": "en", "seed": 1,
            "voice_settings": {"stability": 0.5}, "pronunciation_dictionary_locators": [], "previous_text": "a",
            "next_text": "b", "previous_request_ids": [], "next_request_ids": [], "use_pvc_as_ivc": False,
            "apply_text_normalization": "auto", "apply_language_text_normalization": False, "audio_effects": {}}
    parsed = elevenlabs_http.parse_request("v", {"enable_logging": "true"}, body, VARIANT, streamed=True,
                                           timestamps=True)
    assert (parsed.routed.model, parsed.routed.language, parsed.seed, parsed.timestamps) == ("english", None, 1, True)
    assert elevenlabs_http.media_type(parsed) == "application/json"


# ---- Cartesia -------------------------------------------------------------------------------------


def cartesia_handler(seen: list[cartesia_http.TtsRequest]) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        sse = request.url.path == "/tts/sse"
        request_id = str(uuid.uuid4())
        try:
            parsed = cartesia_http.parse_request(orjson.loads(request.content), VARIANT, sse=sse)
        except FieldError as exc:
            status, body = cartesia_http.error_body(exc, request_id)
            return httpx.Response(status, json=body)
        seen.append(parsed)
        audio = encode(parsed.output)
        if not sse:
            return httpx.Response(200, content=audio, headers={"content-type": parsed.output.mime_type})
        ctx = alignment_of(parsed.transcript, PCM_S * 1000)
        events = cartesia_http.chunk_event(audio, parsed.context_id)
        if parsed.add_timestamps:
            events += cartesia_http.timestamps_event(ctx.segments[0], parsed.context_id)
        events += cartesia_http.done_event(parsed.context_id)
        return httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})

    return handle


@pytest.fixture
def cartesia() -> tuple[Any, list[cartesia_http.TtsRequest]]:
    from cartesia import Cartesia

    seen: list[cartesia_http.TtsRequest] = []
    return Cartesia(api_key="k", base_url="http://test", http_client=transport(cartesia_handler(seen))), seen


@pytest.mark.parametrize(("output_format", "expected"), [
    ({"container": "mp3", "sample_rate": 44_100, "bit_rate": 128_000}, StreamFormat("mp3", "mp3", 44_100, 128_000)),
    ({"container": "wav", "encoding": "pcm_f32le", "sample_rate": 16_000}, StreamFormat("wav", "pcm_f32le", 16_000)),
    ({"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}, StreamFormat("raw", "pcm_s16le", 24_000)),
])
def test_cartesia_bytes(cartesia: tuple[Any, list[Any]], output_format: dict[str, Any], expected: StreamFormat) -> None:
    client, seen = cartesia
    audio = b"".join(client.tts.bytes(model_id="sonic-2", transcript=TEXT, voice={"mode": "id", "id": "a0e99841"},
                                      output_format=output_format))
    assert seen[0].output == expected and seen[0].voice_id == "a0e99841"
    if expected.container == "raw":
        assert len(audio) == int(PCM_S * 24_000) * 2
    else:
        assert abs(decoded_seconds(audio) - PCM_S) < 0.1


def test_cartesia_sse_events_parse_in_the_sdk(cartesia: tuple[Any, list[Any]]) -> None:
    client, seen = cartesia
    events = list(client.tts.generate_sse(
        model_id="sonic-2", transcript=TEXT, voice={"mode": "id", "id": "v"}, add_timestamps=True, context_id="c1",
        output_format={"container": "raw", "encoding": "pcm_f32le", "sample_rate": 16_000},
    ))
    assert [e.type for e in events] == ["chunk", "timestamps", "done"]
    assert seen[0].sse and seen[0].add_timestamps and seen[0].output == StreamFormat("raw", "pcm_f32le", 16_000)
    assert all(e.context_id == "c1" for e in events)
    audio = np.frombuffer(events[0].audio, "<f4")
    assert len(audio) == int(PCM_S * 16_000) and np.abs(audio).max() <= 1.0
    words = events[1].word_timestamps
    assert words.words == TEXT.split() and words.start == sorted(words.start) and words.end[-1] == pytest.approx(PCM_S)


def test_cartesia_refusal_reaches_the_sdk(cartesia: tuple[Any, list[Any]]) -> None:
    from cartesia import BadRequestError

    client, _ = cartesia
    with pytest.raises(BadRequestError) as exc:
        b"".join(client.tts.bytes(model_id="sonic-2", transcript=TEXT, voice={"mode": "id", "id": "v"},
                                  output_format={"container": "mp3", "sample_rate": 44_100}))
    body: dict[str, Any] = exc.value.body  # type: ignore[assignment]
    assert body["title"] == "Invalid request" and "bit_rate" in body["message"]


@pytest.mark.parametrize(("body", "sse", "field"), [
    ({"transcript": "hi", "voice": "v"}, False, "output_format"),
    ({"voice": "v", "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 8_000}}, False,
     "transcript"),
    ({"transcript": "hi", "add_timestamps": True}, False, "add_timestamps"),  # a /tts/sse field
    ({"transcript": "hi", "continue": True}, True, "continue"),  # a WebSocket field
    ({"transcript": "hi", "language": "en", "locale": "en-US"}, True, "locale"),
    ({"transcript": "hi", "language": "de"}, True, "language"),
    ({"transcript": "hi", "voice": 3}, True, "voice"),
    ({"transcript": "hi", "context_id": ""}, True, "context_id"),
    ({"transcript": "hi", "model_id": "multilingual"}, True, "model_id"),
])
def test_cartesia_refusals(body: dict[str, Any], sse: bool, field: str) -> None:
    with pytest.raises(FieldError) as exc:
        cartesia_http.parse_request(body, VARIANT, sse=sse)
    assert exc.value.field == field


def test_cartesia_error_event_shape() -> None:
    raw = cartesia_http.error_event(429, "Busy", "no free slot", "busy", "r1", "c1")
    assert raw.startswith(b"event: error\ndata: ") and raw.endswith(b"\n\n")
    body = orjson.loads(raw.split(b"data: ", 1)[1])
    assert body == {"type": "error", "done": True, "context_id": "c1", "title": "Busy", "message": "no free slot",
                    "error_code": "busy", "status_code": 429, "request_id": "r1"}


# ---- Deepgram -------------------------------------------------------------------------------------


def deepgram_handler(seen: list[deepgram_http.SpeakRequest]) -> Callable[[httpx.Request], httpx.Response]:
    def handle(request: httpx.Request) -> httpx.Response:
        request_id = str(uuid.uuid4())
        try:
            parsed = deepgram_http.parse_request(dict(request.url.params), orjson.loads(request.content), VARIANT)
        except FieldError as exc:
            status, body = deepgram_http.error_body(exc, request_id)
            return httpx.Response(status, json=body)
        seen.append(parsed)
        headers = deepgram_http.response_headers(parsed, request_id)
        return httpx.Response(200, content=encode(parsed.output), headers=headers)

    return handle


@pytest.fixture
def deepgram() -> tuple[Any, list[deepgram_http.SpeakRequest]]:
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment

    seen: list[deepgram_http.SpeakRequest] = []
    env = DeepgramClientEnvironment(base="http://test", production="ws://test", agent="ws://test", agent_rest="http://test")
    return DeepgramClient(api_key="k", environment=env, httpx_client=transport(deepgram_handler(seen))), seen


def test_deepgram_generate_with_sdk_defaults_gets_wav(deepgram: tuple[Any, list[Any]]) -> None:
    client, seen = deepgram
    audio = b"".join(client.speak.v1.audio.generate(text=TEXT))
    assert seen[0].output == StreamFormat("wav", "pcm_s16le", 24_000) and seen[0].model == "aura-asteria-en"
    assert decoded_seconds(audio) == pytest.approx(PCM_S)


@pytest.mark.parametrize(("kwargs", "codec"), [
    ({"encoding": "mp3"}, "mp3"), ({"encoding": "opus"}, "opus"), ({"encoding": "aac", "bit_rate": 64_000}, "aac"),
    ({"encoding": "flac", "sample_rate": 16_000}, "flac"), ({"encoding": "mulaw", "container": "wav"}, "mulaw"),
])
def test_deepgram_compressed_encodings(deepgram: tuple[Any, list[Any]], kwargs: dict[str, Any], codec: str) -> None:
    client, seen = deepgram
    audio = b"".join(client.speak.v1.audio.generate(text=TEXT, model="aura-2-thalia-en", **kwargs))
    assert seen[0].output.codec == codec
    assert abs(decoded_seconds(audio) - PCM_S) < 0.12


def test_deepgram_refusal_reaches_the_sdk(deepgram: tuple[Any, list[Any]]) -> None:
    from deepgram.errors import BadRequestError

    client, _ = deepgram
    with pytest.raises(BadRequestError) as exc:
        b"".join(client.speak.v1.audio.generate(text=TEXT, encoding="mp3", sample_rate=44_100))
    assert exc.value.body["err_code"] == "INVALID_QUERY_PARAMETER" and "sample_rate" in exc.value.body["err_msg"]


@pytest.mark.parametrize(("query", "body", "field"), [
    ({"callback": "https://example.com/hook"}, {"text": "hi"}, "callback"),
    ({}, {"text": "hi", "voice": "a"}, "voice"),
    ({"model": "turbo"}, {"text": "hi"}, "model"),
    ({"seed": "x"}, {"text": "hi"}, "seed"),
])
def test_deepgram_refusals(query: dict[str, str], body: dict[str, Any], field: str) -> None:
    with pytest.raises(FieldError) as exc:
        deepgram_http.parse_request(query, body, VARIANT)
    assert exc.value.field == field
    status, rendered = deepgram_http.error_body(exc.value, "r")
    assert status == 400 and rendered["request_id"] == "r" and rendered["err_msg"].startswith(field)
