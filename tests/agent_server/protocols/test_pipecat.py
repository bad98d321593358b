"""Pipecat's WebSocket TTS services (and OpenAI's), unmodified, in a minimal pipeline with a barge-in, pointed at
our server. `assert_barge_in_pipeline` is the scenario; test_pipecat_http.py runs it for the HTTP and gRPC
services."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import openai
import pytest

pytest.importorskip("pipecat")

from pipecat.frames.frames import (
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
)
from pipecat.pipeline.worker import PipelineParams
from pipecat.services.cartesia.tts import CartesiaTTSService
from pipecat.services.deepgram.tts import DeepgramTTSService
from pipecat.services.elevenlabs.dialogue.tts import ElevenLabsDialogueTTSService
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.services.tts_service import TTSService
from pipecat.tests.utils import SleepFrame, run_test

from synth.api import SegmentRequest

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

TURN1 = ["Well, ", "let me ", "tell you ", "a rather ", "long story ", "about it. "] * 4
TURN2 = "Okay, sure thing."

Factory = Callable[[Served, aiohttp.ClientSession], TTSService]
SERVICES: dict[str, tuple[Factory, int]] = {
    "elevenlabs": (lambda s, _: ElevenLabsTTSService(
        api_key="sk", url=s.ws,
        settings=ElevenLabsTTSService.Settings(voice="JBFqnCBsd6RMkjVDRZzb", model="eleven_flash_v2_5")), 16_000),
    # eleven_v3: text to dialogue's multi-stream-input (protocols/elevenlabs_dialogue.py)
    "elevenlabs_dialogue": (lambda s, _: ElevenLabsDialogueTTSService(
        api_key="sk", url=s.ws,
        settings=ElevenLabsDialogueTTSService.Settings(voice="JBFqnCBsd6RMkjVDRZzb", model="eleven_v3")), 16_000),
    "cartesia": (lambda s, _: CartesiaTTSService(
        api_key="sk", url=s.ws + "/tts/websocket",
        settings=CartesiaTTSService.Settings(voice="a0e99841-438c-4a64-b679-ae501e7d6091")), 16_000),
    "deepgram": (lambda s, _: DeepgramTTSService(
        api_key="dg", base_url=s.ws, settings=DeepgramTTSService.Settings(voice="aura-2-helena-en")), 16_000),
    "openai": (lambda s, _: OpenAITTSService(
        api_key="sk", base_url=s.http + "/v1", settings=OpenAITTSService.Settings(voice="alloy"),
        http_client=openai.DefaultAsyncHttpxClient()), 24_000),
}


def samples_made(engine: FakeEngine, requests: list[SegmentRequest]) -> int:
    return sum(FakeEngine.token_count(r.text, engine.tokens_per_char) * 960 for r in requests)


def assert_barge_in_pipeline(served: Served, factory: Factory, rate_hz: int, turn1: list[str],
                             server_told: bool = True) -> None:
    """A turn, a barge-in while it speaks, a second turn: the first turn's engine work is cancelled and its
    audio stops short; the second is heard whole, at the rate the pipeline asked for. `server_told=False`: the
    service sends the server nothing at a barge-in, so only the client-side stop is asserted."""
    engine = served.engine
    frames = [
        LLMFullResponseStartFrame(), *[LLMTextFrame(piece) for piece in turn1], LLMFullResponseEndFrame(),
        SleepFrame(sleep=1.2),  # the first audio is out, most of the turn is not
        InterruptionFrame(),
        SleepFrame(sleep=0.3),
        LLMFullResponseStartFrame(), LLMTextFrame(TURN2), LLMFullResponseEndFrame(),
        SleepFrame(sleep=2.5),
    ]

    async def main() -> list[object]:
        async with aiohttp.ClientSession() as http:
            service = factory(served, http)
            try:
                down, _ = await run_test(service, frames_to_send=frames,
                                         pipeline_params=PipelineParams(audio_out_sample_rate=rate_hz))
            finally:
                client = getattr(service, "_client", None)  # Pipecat never closes the OpenAI client it was given
                if isinstance(client, openai.AsyncOpenAI):
                    await client.close()
        return list(down)

    down = asyncio.run(main())
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    assert audio and all(f.sample_rate == rate_hz and f.num_channels == 1 for f in audio)
    if server_told:
        assert engine.cancels, "the barge-in cancelled the engine work of the first turn"
    turn2 = [r for r in engine.submits if r.text.strip() and r.text.strip() in TURN2]
    assert turn2, "the second turn reached the engine"
    last_context = audio[-1].context_id
    turn2_bytes = sum(len(f.audio) for f in audio if f.context_id == last_context)
    expected = samples_made(engine, turn2) * rate_hz / 24_000
    assert expected - 2 <= turn2_bytes // 2 <= expected + 0.06 * rate_hz * len(turn2), (turn2_bytes // 2, expected)
    turn1_requests = [r for r in engine.submits if r not in turn2]
    turn1_bytes = sum(len(f.audio) for f in audio if f.context_id != last_context)
    assert turn1_bytes // 2 < samples_made(engine, turn1_requests) * rate_hz / 24_000 / 2, "turn 1 stopped short"


# Pipecat's text-to-dialogue service closes a turn's context at the turn's end (`close_context`: speak what was
# sent) and sends nothing at a later barge-in: it drops the rest of that context's audio itself. The server cannot
# tell the turn was abandoned and generates it to its end, as the vendor does (docs/compatibility.md, Known gaps);
# whether that end comes before the socket closes (which cancels it) is a race, so no cancel is asserted.
SERVER_NOT_TOLD = {"elevenlabs_dialogue"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_pipeline_with_barge_in(served_realtime: Served, name: str) -> None:
    factory, rate_hz = SERVICES[name]
    assert_barge_in_pipeline(served_realtime, factory, rate_hz, TURN1, server_told=name not in SERVER_NOT_TOLD)


def test_elevenlabs_speed_setting_reaches_the_audio(served: Served) -> None:
    """Pipecat puts its `speed` setting in each context's first message (`voice_settings`): the turn comes back
    played that much faster."""
    frames = [LLMFullResponseStartFrame(), *[LLMTextFrame(piece) for piece in TURN1], LLMFullResponseEndFrame(),
              SleepFrame(sleep=2.0)]

    async def main() -> list[object]:
        service = ElevenLabsTTSService(api_key="sk", url=served.ws, settings=ElevenLabsTTSService.Settings(
            voice="JBFqnCBsd6RMkjVDRZzb", model="eleven_flash_v2_5", speed=1.2))
        down, _ = await run_test(service, frames_to_send=frames,
                                 pipeline_params=PipelineParams(audio_out_sample_rate=24_000))
        return list(down)

    audio = [f for f in asyncio.run(main()) if isinstance(f, TTSAudioRawFrame)]
    played = sum(len(f.audio) for f in audio) // 2
    made = samples_made(served.engine, served.engine.submits)
    assert made > 5 * 24_000  # long enough that 1.2x is far outside the tolerance
    assert abs(played - made / 1.2) <= 0.1 * 24_000 * len(served.engine.submits), (played, made)
