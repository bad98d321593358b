"""Pipecat's HTTP TTS services and its Riva (NVIDIA) gRPC service, unmodified, in a minimal pipeline with
a barge-in, pointed at our server: ElevenLabsHttpTTSService, CartesiaHttpTTSService, DeepgramHttpTTSService
and NvidiaTTSService (nvidia-riva-client's `SynthesizeOnline` against --grpc-port), in the scenario
test_pipecat.py runs for the WebSocket services."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pipecat")

from pipecat.services.cartesia.tts import CartesiaHttpTTSService
from pipecat.services.deepgram.tts import DeepgramHttpTTSService
from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService
from pipecat.services.nvidia.tts import NvidiaTTSService

from tests.agent_server.protocols.conftest import Served
from tests.agent_server.protocols.test_pipecat import Factory, assert_barge_in_pipeline

pytestmark = pytest.mark.timeout(90)

# whole sentences: the HTTP services make one request per sentence
TURN1 = ["Well, let me tell you a rather long story about it. ", "It goes on and on, sentence after sentence. ",
         "And then it goes on some more, for quite a while. ", "There is no end to it in sight at all. "] * 2
RATE_HZ = 16_000

SERVICES: dict[str, Factory] = {
    "elevenlabs": lambda s, http: ElevenLabsHttpTTSService(
        api_key="sk", aiohttp_session=http, base_url=s.http,
        settings=ElevenLabsHttpTTSService.Settings(voice="JBFqnCBsd6RMkjVDRZzb", model="eleven_flash_v2_5")),
    "cartesia": lambda s, http: CartesiaHttpTTSService(
        api_key="sk", aiohttp_session=http, base_url=s.http,
        settings=CartesiaHttpTTSService.Settings(voice="a0e99841-438c-4a64-b679-ae501e7d6091")),
    "deepgram": lambda s, http: DeepgramHttpTTSService(
        api_key="dg", aiohttp_session=http, base_url=s.http,
        settings=DeepgramHttpTTSService.Settings(voice="aura-2-helena-en")),
    "riva": lambda s, _: NvidiaTTSService(server=s.grpc, use_ssl=False),
}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_pipeline_with_barge_in(served_grpc_realtime: Served, name: str) -> None:
    assert_barge_in_pipeline(served_grpc_realtime, SERVICES[name], RATE_HZ, TURN1)
    hub = served_grpc_realtime.live.hub
    deadline_s = time.monotonic() + 5.0
    while hub.sessions:  # every request's (and call's) session ends
        assert time.monotonic() < deadline_s, len(hub.sessions)
        time.sleep(0.01)
