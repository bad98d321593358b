"""Speed through every protocol that has it (codecs.TempoEncoder): OpenAI `speed`, ElevenLabs
`voice_settings.speed`, Cartesia `generation_config.speed` and `speed`, Deepgram's `speed` query, the
native `speed`. The audio a client gets is the engine's audio played that much faster (its length divided
by the speed, to atempo's edges), word timings follow it, and a speed out of range is refused in the
protocol's own form, naming the field."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.agent_server.native_client import NativeClient
from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

TEXT = "Sure, I can help with that. Your flight leaves at nine fifteen tomorrow morning."
# atempo's edges (tests/agent_server/audio/test_codecs.py) per run of the filter (one per drain and the finish),
# plus the drain's padding and the resampler's tail per segment
EDGE_PER_SEGMENT_S = 0.035 + 0.06


def engine_seconds(served: Served) -> tuple[float, int]:
    samples, segments = served.produced()
    return samples / 24_000, segments


def assert_played_faster(served: Served, seconds: float, speed: float) -> None:
    made_s, segments = engine_seconds(served)
    assert made_s > 1.0
    assert abs(seconds - made_s / speed) <= segments * EDGE_PER_SEGMENT_S + 0.01, (seconds, made_s, speed, segments)


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:
        yield client


def test_openai_speed(served: Served) -> None:
    import openai

    with openai.OpenAI(api_key="sk-test", base_url=served.http + "/v1", max_retries=0) as client:
        pcm = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, speed=1.5,
                                         response_format="pcm").content
        assert_played_faster(served, len(pcm) / 2 / 24_000, 1.5)
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, speed=5.0)
    assert refused.value.param == "speed"


def test_elevenlabs_voice_settings_speed_moves_the_word_timings_too(served: Served, http: httpx.Client) -> None:
    from elevenlabs import ElevenLabs, VoiceSettings
    from elevenlabs.core.api_error import ApiError

    client = ElevenLabs(api_key="sk-test", base_url=served.http, httpx_client=http)
    answer = client.text_to_speech.convert_with_timestamps("default", text=TEXT, output_format="pcm_24000",
                                                           voice_settings=VoiceSettings(speed=1.2, stability=0.5))
    seconds = len(base64.b64decode(answer.audio_base_64)) / 2 / 24_000
    assert_played_faster(served, seconds, 1.2)
    assert answer.alignment is not None
    last_end_s = answer.alignment.character_end_times_seconds[-1]
    assert abs(last_end_s - seconds) < 0.15, (last_end_s, seconds)  # the text ends where the audio does
    with pytest.raises(ApiError) as refused:
        b"".join(client.text_to_speech.convert("default", text=TEXT, voice_settings=VoiceSettings(speed=0.1)))
    assert refused.value.status_code == 422
    assert refused.value.body["detail"][0]["loc"] == ["body", "voice_settings", "speed"]


def test_elevenlabs_websocket_takes_the_speed_of_the_first_message(served: Served) -> None:
    import orjson
    from websockets.asyncio.client import connect

    async def scenario() -> bytes:
        url = served.ws + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000"
        audio = b""
        async with connect(url) as ws:
            await ws.send(orjson.dumps({"text": " ", "voice_settings": {"speed": 0.8}}).decode())
            await ws.send(orjson.dumps({"text": TEXT, "flush": True}).decode())
            await ws.send(orjson.dumps({"text": ""}).decode())
            async for raw in ws:
                message = orjson.loads(raw)
                if message.get("audio"):
                    audio += base64.b64decode(message["audio"])
                if message.get("isFinal"):
                    break
        return audio

    audio = asyncio.run(scenario())
    assert_played_faster(served, len(audio) / 2 / 24_000, 0.8)


@pytest.mark.parametrize(("body", "speed"), [({"generation_config": {"speed": 1.4}}, 1.4), ({"speed": "fast"}, 1.15),
                                             ({"voice": {"mode": "id", "id": "default",
                                                         "__experimental_controls": {"speed": -1.0}}}, 0.7)])
def test_cartesia_speeds(served: Served, http: httpx.Client, body: dict[str, Any], speed: float) -> None:
    request = {"model_id": "sonic-2", "transcript": TEXT, "voice": {"mode": "id", "id": "default"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}, **body}
    response = http.post(served.http + "/tts/bytes", json=request, headers={"Cartesia-Version": "2025-04-16"})
    assert response.status_code == 200, response.text
    assert_played_faster(served, len(response.content) / 2 / 24_000, speed)


def test_cartesia_refuses_a_speed_it_cannot_play(served: Served, http: httpx.Client) -> None:
    for body, field in (({"generation_config": {"speed": 9}}, "generation_config.speed"),
                        ({"speed": "warp"}, "speed")):
        request = {"model_id": "sonic-2", "transcript": TEXT, "voice": {"mode": "id", "id": "default"},
                   "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}, **body}
        response = http.post(served.http + "/tts/bytes", json=request)
        assert response.status_code == 400 and field in response.json()["message"], response.text


def test_deepgram_speed(served: Served, http: httpx.Client) -> None:
    from deepgram import DeepgramClient
    from deepgram.core.api_error import ApiError
    from deepgram.environment import DeepgramClientEnvironment

    env = DeepgramClientEnvironment(base=served.http, production=served.ws, agent=served.ws, agent_rest=served.http)
    client = DeepgramClient(api_key="dg-test", environment=env, httpx_client=http)
    audio = b"".join(client.speak.v1.audio.generate(text=TEXT, speed=0.9, container="none"))
    assert_played_faster(served, len(audio) / 2 / 24_000, 0.9)
    with pytest.raises(ApiError) as refused:
        b"".join(client.speak.v1.audio.generate(text=TEXT, speed=0.1))
    assert refused.value.status_code == 400


def test_native_speed(served: Served) -> None:
    async def scenario() -> tuple[bytes, list[dict[str, Any]], list[dict[str, Any]]]:
        client = await NativeClient.connect(served.ws + "/v1/stream")
        log = await client.open("fast", text=TEXT, speed=1.25)
        await client.end("fast")
        await asyncio.wait_for(log.finished.wait(), 20)
        await client.open("bad", speed=0)
        error = await asyncio.wait_for(client.errors.get(), 5)
        await client.close()
        return log.audio, log.segments_done, [error]

    audio, segments, errors = asyncio.run(scenario())
    assert_played_faster(served, len(audio) / 2 / 24_000, 1.25)
    made_s, _ = engine_seconds(served)
    assert abs(sum(s["audio_ms"] for s in segments) / 1000 - made_s / 1.25) < 0.01  # segments as they play
    assert errors[0]["field"] == "speed" and errors[0]["context_id"] == "bad"


def test_deepgram_websocket_speed(served: Served) -> None:
    from deepgram import DeepgramClient
    from deepgram.environment import DeepgramClientEnvironment
    from deepgram.speak.v1.types import SpeakV1Text

    env = DeepgramClientEnvironment(base=served.http, production=served.ws, agent=served.ws, agent_rest=served.http)
    client = DeepgramClient(api_key="dg-test", environment=env)
    with client.speak.v1.connect(model="aura-2-thalia-en", encoding="linear16", sample_rate="24000",
                                 speed="1.3") as conn:
        conn.send_text(SpeakV1Text(text=TEXT))
        conn.send_flush()
        audio = b""
        for message in conn:
            if isinstance(message, bytes):
                audio += message
            elif str(message.type) == "Flushed":
                break
        conn.send_close()
    assert_played_faster(served, len(audio) / 2 / 24_000, 1.3)


def test_cartesia_websocket_speed_is_the_contexts_first_requests(served: Served) -> None:
    import orjson
    from websockets.asyncio.client import connect

    async def scenario() -> bytes:
        request = {"context_id": "c", "model_id": "sonic-3", "voice": {"mode": "id", "id": "default"},
                   "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000},
                   "generation_config": {"speed": 0.75}}
        audio = b""
        async with connect(served.ws + "/tts/websocket") as ws:
            await ws.send(orjson.dumps({**request, "transcript": TEXT, "continue": False}).decode())
            async for raw in ws:
                message = orjson.loads(raw)
                assert message["type"] != "error", message
                if message["type"] == "chunk":
                    audio += base64.b64decode(message["data"])
                if message.get("done"):
                    break
        return audio

    audio = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert_played_faster(served, len(audio) / 2 / 24_000, 0.75)
