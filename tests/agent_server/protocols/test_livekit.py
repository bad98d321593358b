"""LiveKit Agents' TTS plugins, unmodified, through their stream API (OpenAI's: synthesize), pointed at our server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("livekit.agents")

import aiohttp
from livekit.plugins import cartesia, deepgram, elevenlabs
from livekit.plugins import openai as lk_openai

from tests.agent_server.protocols.conftest import Served, assert_length

pytestmark = pytest.mark.timeout(60)

PIECES = ["Sure, I ", "can help ", "with that. ", "Your flight ", "leaves at ", "nine ", "tomorrow."]

PLUGINS: dict[str, tuple[Callable[[Served, aiohttp.ClientSession], Any], int]] = {
    "elevenlabs": (lambda s, h: elevenlabs.TTS(api_key="sk", base_url=s.http + "/v1", encoding="pcm_16000",
                                               http_session=h), 16_000),
    # eleven_v3 (and v4): the plugin speaks text-to-dialogue multi-stream-input (protocols/elevenlabs_dialogue.py)
    "elevenlabs_v3": (lambda s, h: elevenlabs.TTS(api_key="sk", base_url=s.http + "/v1", model="eleven_v3",
                                                  encoding="pcm_16000", http_session=h), 16_000),
    "cartesia": (lambda s, h: cartesia.TTS(api_key="sk", base_url=s.http, sample_rate=16_000, http_session=h), 16_000),
    "deepgram": (lambda s, h: deepgram.TTS(api_key="dg", base_url=s.http + "/v1/speak", sample_rate=16_000,
                                           http_session=h), 16_000),
    "openai": (lambda s, h: lk_openai.TTS(api_key="sk", base_url=s.http + "/v1", response_format="pcm"), 24_000),
}


async def _speak(served: Served, name: str, interrupt: bool) -> tuple[int, set[int]]:
    factory, _ = PLUGINS[name]
    async with aiohttp.ClientSession() as http:
        tts = factory(served, http)
        pieces = PIECES * (6 if interrupt else 1)
        if tts.capabilities.streaming:
            stream = tts.stream()
            for piece in pieces:
                stream.push_text(piece)
            stream.end_input()
        else:  # OpenAI's plugin has no stream(): agents wrap synthesize() in a StreamAdapter per sentence
            stream = tts.synthesize("".join(pieces))
        n_bytes, rates = 0, set()
        async for event in stream:
            frame = event.frame
            n_bytes += len(frame.data.tobytes())
            rates.add(frame.sample_rate)
            if interrupt:
                break  # barge-in: the agent drops the stream
        await stream.aclose()
        await tts.aclose()
    return n_bytes, rates


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_stream(served: Served, name: str) -> None:
    n_bytes, rates = asyncio.run(_speak(served, name, interrupt=False))
    rate_hz = PLUGINS[name][1]
    assert rates == {rate_hz}
    assert_length(served, n_bytes, rate_hz)


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_stream_closed_early_is_a_barge_in(served_realtime: Served, name: str) -> None:
    engine = served_realtime.engine
    asyncio.run(_speak(served_realtime, name, interrupt=True))
    stop = time.monotonic() + 5
    while not engine.cancels and time.monotonic() < stop:
        time.sleep(0.02)
    assert engine.cancels, "closing the stream cancelled the engine work"


def test_elevenlabs_list_voices(served: Served) -> None:
    async def listed() -> list[Any]:
        async with aiohttp.ClientSession() as http:
            tts = elevenlabs.TTS(api_key="sk", base_url=served.http + "/v1", http_session=http)
            voices = await tts.list_voices()
            await tts.aclose()
            return voices

    voices = asyncio.run(listed())
    assert [(v.id, v.name, v.category) for v in voices] == [("default", "default", "premade")]


def test_elevenlabs_v3_synthesize_is_text_to_dialogue_over_http(served: Served) -> None:
    """`synthesize` with a dialogue model posts to /v1/text-to-dialogue/stream (one line, its voice)."""
    async def synthesized() -> tuple[int, set[int]]:
        async with aiohttp.ClientSession() as http:
            tts = PLUGINS["elevenlabs_v3"][0](served, http)
            n_bytes, rates = 0, set()
            async for event in tts.synthesize("".join(PIECES)):
                n_bytes += len(event.frame.data.tobytes())
                rates.add(event.frame.sample_rate)
            await tts.aclose()
            return n_bytes, rates

    n_bytes, rates = asyncio.run(synthesized())
    assert rates == {16_000}
    assert_length(served, n_bytes, 16_000)
    assert len(served.engine.submits) == 2  # the text's two sentences, the default voice's
