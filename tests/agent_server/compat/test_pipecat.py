"""Pipecat's TTS services, unmodified, in a minimal pipeline with a barge-in, pointed at our server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

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
from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.services.tts_service import TTSService
from pipecat.tests.utils import SleepFrame, run_test

from tests.agent_server.compat.conftest import Served
from tests.agent_server.fake_engine import FakeEngine

pytestmark = pytest.mark.timeout(60)

TURN1 = ["Well, ", "let me ", "tell you ", "a rather ", "long story ", "about it. "] * 4
TURN2 = "Okay, sure thing."

SERVICES: dict[str, tuple[Callable[[Served], TTSService], int]] = {
    "elevenlabs": (lambda s: ElevenLabsTTSService(
        api_key="sk", url=s.ws,
        settings=ElevenLabsTTSService.Settings(voice="JBFqnCBsd6RMkjVDRZzb", model="eleven_flash_v2_5")), 16_000),
    "cartesia": (lambda s: CartesiaTTSService(
        api_key="sk", url=s.ws + "/tts/websocket",
        settings=CartesiaTTSService.Settings(voice="a0e99841-438c-4a64-b679-ae501e7d6091")), 16_000),
    "deepgram": (lambda s: DeepgramTTSService(
        api_key="dg", base_url=s.ws, settings=DeepgramTTSService.Settings(voice="aura-2-helena-en")), 16_000),
    "openai": (lambda s: OpenAITTSService(
        api_key="sk", base_url=s.http + "/v1", settings=OpenAITTSService.Settings(voice="alloy"),
        http_client=openai.DefaultAsyncHttpxClient()), 24_000),
}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_pipeline_with_barge_in(served_realtime: Served, name: str) -> None:
    factory, rate_hz = SERVICES[name]
    engine = served_realtime.engine
    frames = [
        LLMFullResponseStartFrame(), *[LLMTextFrame(piece) for piece in TURN1], LLMFullResponseEndFrame(),
        SleepFrame(sleep=1.2),  # the first audio is out, most of the turn is not
        InterruptionFrame(),
        SleepFrame(sleep=0.3),
        LLMFullResponseStartFrame(), LLMTextFrame(TURN2), LLMFullResponseEndFrame(),
        SleepFrame(sleep=2.5),
    ]

    async def main() -> list[object]:
        service = factory(served_realtime)
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
    assert engine.cancels, "the barge-in cancelled the engine work of the first turn"
    turn2 = [r for r in engine.submits if r.text.strip() and r.text.strip() in TURN2]
    assert turn2, "the second turn reached the engine"
    turn2_samples_24k = sum(
        len(FakeEngine.expected_tokens(r.text, engine.seed_of(r.request_id))) * 960 for r in turn2
    )
    last_context = audio[-1].context_id
    turn2_bytes = sum(len(f.audio) for f in audio if f.context_id == last_context)
    expected = turn2_samples_24k * rate_hz / 24_000
    assert expected - 2 <= turn2_bytes // 2 <= expected + 0.06 * rate_hz * len(turn2)
    turn1_texts = [r for r in engine.submits if r not in turn2]
    turn1_full = sum(len(FakeEngine.expected_tokens(r.text, engine.seed_of(r.request_id))) * 960 for r in turn1_texts)
    turn1_bytes = sum(len(f.audio) for f in audio if f.context_id != last_context)
    assert turn1_bytes // 2 < turn1_full * rate_hz / 24_000 / 2, "the first turn's audio stopped at the barge-in"
