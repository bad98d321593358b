"""OpenAI POST /v1/audio/speech with the unmodified `openai` SDK (base_url = our /v1)."""

from __future__ import annotations

import base64
import json
import time

import openai
import pytest

from agent_server.audio.formats import float_to_pcm16
from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.errors import FieldError
from agent_server.protocols import openai_speech

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocols.conftest import Served, assert_length

pytestmark = pytest.mark.timeout(60)

ENGLISH = Router(DEFAULT_ROUTES, ("english",))  # one model loaded, the built-in route table
TEXT = "Sure, I can help with that. Your flight leaves at nine fifteen tomorrow morning."


def client(served: Served) -> openai.OpenAI:
    """Use it in a `with`: its connection pool keeps sockets open otherwise."""
    return openai.OpenAI(api_key="sk-test", base_url=served.http + "/v1", max_retries=0)


def test_streaming_pcm(served: Served) -> None:
    with client(served) as c, c.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TEXT, response_format="pcm"
    ) as response:
        assert response.headers["content-type"].startswith("audio/pcm")
        audio = b"".join(response.iter_bytes())
    assert_length(served, len(audio), 24_000)


def test_wav_and_seed(served: Served) -> None:
    def speak(seed: int) -> bytes:
        with client(served) as c:
            return c.audio.speech.create(
                model="tts-1", voice="nova", input="Hello there, how are you?", response_format="wav",
                extra_body={"seed": seed},
            ).read()

    a, b, c = speak(3), speak(3), speak(4)
    assert a[:4] == b"RIFF" and a[8:12] == b"WAVE"
    assert a == b and a != c
    expected = float_to_pcm16(FakeEngine.expected_pcm("Hello there, how are you?", 3)).astype("<i2").tobytes()
    assert a[44:] == expected


def test_sse(served: Served) -> None:
    with client(served) as c, c.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input=TEXT, response_format="pcm", stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert_length(served, len(audio), 24_000)


def test_errors_in_openai_shape(served: Served) -> None:
    with client(served) as c:
        with pytest.raises(openai.BadRequestError) as raised:
            c.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="ogg")  # type: ignore[arg-type]
        assert raised.value.body["param"] == "response_format"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as raised:
            c.audio.speech.create(model="multilingual", voice="alloy", input=TEXT, response_format="pcm")
        assert raised.value.body["param"] == "model"  # type: ignore[index]


def test_closing_the_response_is_a_barge_in(served_realtime: Served) -> None:
    engine = served_realtime.engine
    with client(served_realtime) as c, c.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT * 3, response_format="pcm"
    ) as response:
        next(response.iter_bytes())
    deadline = time.monotonic() + 5
    while not engine.cancels and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.cancels, "closing the response cancelled the engine work"


def test_parse_request() -> None:
    r = openai_speech.parse_request({"model": "tts-1", "input": "hi", "voice": {"id": "v1"}, "response_format": "pcm",
                                     "speed": 1.0, "seed": 5}, ENGLISH)
    assert (r.voice, r.seed, r.stream_format) == ("v1", 5, "audio")
    for bad in ({"input": "hi", "voice": "a"}, {"model": "m", "voice": "a", "input": ""},
                {"model": "m", "voice": "a", "input": "x", "speed": 9},
                {"model": "m", "voice": "a", "input": "x", "foo": 1},
                {"model": "m", "voice": "a", "input": "x", "response_format": "pcm", "stream_format": "chunks"}):
        with pytest.raises(FieldError):
            openai_speech.parse_request(bad, ENGLISH)
