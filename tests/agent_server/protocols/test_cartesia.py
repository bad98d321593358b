"""Cartesia /tts/websocket with the unmodified `cartesia` SDK (websocket_base_url = our ws:// URL)."""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
import pytest
from cartesia import Cartesia

from agent_server.audio.codecs import StreamFormat
from agent_server.audio.formats import mulaw_to_pcm16
from agent_server.errors import FieldError
from agent_server.protocols import cartesia as ca

from tests.agent_server.protocols.conftest import Served, assert_length

pytestmark = pytest.mark.timeout(60)

PIECES = ["Sure, I ", "can help ", "with that. ", "Your flight ", "leaves at ", "nine ", "tomorrow."]
VOICE: Any = {"mode": "id", "id": "a0e99841-438c-4a64-b679-ae501e7d6091"}  # the SDK types it as its own model


def sdk(served: Served) -> Cartesia:
    return Cartesia(api_key="sk-test", websocket_base_url=served.ws)


@pytest.mark.parametrize("encoding, rate_hz, width", [("pcm_s16le", 16_000, 2), ("pcm_f32le", 44_100, 4),
                                                      ("pcm_mulaw", 8_000, 1)])
def test_context_push_timestamps_flush_done(served: Served, encoding: str, rate_hz: int, width: int) -> None:
    with sdk(served).tts.websocket_connect() as connection:
        ctx = connection.context(
            model_id="sonic-2", voice=VOICE, add_timestamps=True,
            output_format={"container": "raw", "encoding": encoding, "sample_rate": rate_hz},
        )
        for piece in PIECES[:3]:
            ctx.push(piece)
        ctx.push("", flush=True)
        for piece in PIECES[3:]:
            ctx.push(piece)
        ctx.no_more_inputs()
        events = list(ctx.receive())
    kinds = [e.type for e in events]
    assert kinds[-1] == "done" and "flush_done" in kinds and "timestamps" in kinds
    audio = b"".join(e.audio for e in events if e.type == "chunk" and e.audio)
    assert_length(served, len(audio) // width * 2, rate_hz)
    if encoding == "pcm_f32le":
        assert np.abs(np.frombuffer(audio, dtype="<f4")).max() <= 1.0
    if encoding == "pcm_mulaw":
        assert np.abs(mulaw_to_pcm16(np.frombuffer(audio, dtype=np.uint8))).max() > 1000
    stamps = [e.word_timestamps for e in events if e.type == "timestamps" and e.word_timestamps is not None]
    words = [w for stamp in stamps for w in stamp.words]
    assert words == "".join(PIECES).split()
    starts = [s for stamp in stamps for s in stamp.start]
    assert starts == sorted(starts)  # seconds from the context's start


def test_cancel_is_a_barge_in(served_realtime: Served) -> None:
    engine = served_realtime.engine
    with sdk(served_realtime).tts.websocket_connect() as connection:
        first = connection.context("turn1", model_id="sonic-2", voice=VOICE,
                                   output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000})
        first.push("This is a long answer, " * 8)
        next(e for e in first.receive() if e.type == "chunk")
        first.cancel()
        deadline = time.monotonic() + 5
        while not engine.cancels and time.monotonic() < deadline:
            time.sleep(0.02)
        second = connection.context("turn2", model_id="sonic-2", voice=VOICE,
                                    output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24000})
        second.push("Okay.", continue_=False)
        events = list(second.receive())
    assert engine.cancels and all(c.startswith(engine.submits[0].request_id.rsplit("/", 1)[0]) for c in engine.cancels)
    assert events[-1].type == "done" and any(e.type == "chunk" for e in events)


def test_seed_and_errors(served: Served) -> None:
    def speak(seed: int) -> bytes:
        with sdk(served).tts.websocket_connect() as connection:
            ctx = connection.context(model_id="sonic-2", voice=VOICE,
                                     output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000})
            ctx.send(transcript="Hello there, how are you?", voice=VOICE, continue_=False, seed=seed)
            return b"".join(base64.b64decode(e.data) for e in ctx.receive() if e.type == "chunk")

    assert speak(11) == speak(11) != speak(12)
    with sdk(served).tts.websocket_connect() as connection:
        ctx = connection.context(model_id="sonic-2", voice=VOICE,
                                 output_format={"container": "raw", "encoding": "pcm_s16le", "sample_rate": 12345})
        ctx.push("Hi.", continue_=False)
        events = list(ctx.receive())
    assert events[-1].type == "error" and "sample_rate" in (events[-1].message or "")


def test_parse_request() -> None:
    r = ca.parse_request('{"context_id": "c", "transcript": "hi", "voice": {"mode": "id", "id": "v"}, '
                         '"output_format": {"container": "raw", "encoding": "pcm_alaw", "sample_rate": 8000}, '
                         '"continue": true, "model_id": "sonic-2", "seed": 4}')
    assert (r.voice_id, r.output, r.continue_, r.seed) == ("v", StreamFormat("raw", "alaw", 8_000), True, 4)
    assert ca.parse_request('{"context_id": "c", "cancel": true}').cancel
    for bad in ('{"transcript": "x"}', '{"context_id": "c", "output_format": {"container": "ogg"}}',
                '{"context_id": "c", "output_format": {"encoding": "pcm_mulaw", "sample_rate": 16000}}',
                '{"context_id": "c", "bogus": 1}'):
        with pytest.raises(FieldError):
            ca.parse_request(bad)
