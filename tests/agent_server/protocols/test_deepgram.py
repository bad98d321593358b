"""Deepgram /v1/speak with the unmodified `deepgram-sdk` (environment pointed at our server)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from deepgram import DeepgramClient
from deepgram.environment import DeepgramClientEnvironment
from deepgram.speak.v1.types import SpeakV1Text
from websockets.asyncio.client import connect

from agent_server.audio.codecs import StreamFormat
from agent_server.audio.formats import alaw_to_pcm16
from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.errors import FieldError
from agent_server.protocols import deepgram as dg

from tests.agent_server.protocols.conftest import Served, assert_length, serving

pytestmark = pytest.mark.timeout(60)

ENGLISH = Router(DEFAULT_ROUTES, ("english",))  # one model loaded, the built-in route table
PIECES = ["Sure, I ", "can help ", "with that. ", "Your flight ", "leaves at ", "nine ", "tomorrow."]


def sdk(served: Served) -> DeepgramClient:
    env = DeepgramClientEnvironment(base=served.http, production=served.ws, agent=served.ws, agent_rest=served.http)
    return DeepgramClient(api_key="dg-test", environment=env)


def kind(message: object) -> str:
    return "audio" if isinstance(message, bytes) else str(cast(Any, message).type)


@pytest.mark.parametrize(
    ("encoding", "rate_hz", "width"), [("linear16", 16_000, 2), ("linear16", 48_000, 2), ("alaw", 8_000, 1)]
)
def test_speak_flush_close(served: Served, encoding: str, rate_hz: int, width: int) -> None:
    with sdk(served).speak.v1.connect(model="aura-2-thalia-en", encoding=encoding, sample_rate=str(rate_hz)) as conn:
        for piece in PIECES:
            conn.send_text(SpeakV1Text(text=piece))
        conn.send_flush()
        messages = []
        for message in conn:
            messages.append(message)
            if kind(message) == "Flushed":
                break
        conn.send_close()
        messages += list(conn)
    kinds = [kind(m) for m in messages]
    assert kinds[0] == "Metadata" and kinds.count("Flushed") == 1
    audio = b"".join(m for m in messages if isinstance(m, bytes))
    assert_length(served, len(audio) // width * 2, rate_hz)
    if encoding == "alaw":
        assert np.abs(alaw_to_pcm16(np.frombuffer(audio, dtype=np.uint8))).max() > 1000


def test_flushed_follows_all_of_the_flushed_speech(served: Served) -> None:
    with sdk(served).speak.v1.connect(model="aura-2-thalia-en", encoding="linear16", sample_rate="16000") as conn:
        for piece in PIECES:
            conn.send_text(SpeakV1Text(text=piece))
        conn.send_flush()
        messages = []
        for message in conn:
            messages.append(message)
            if kind(message) == "Flushed":
                break
        conn.send_close()
        tail = b"".join(m for m in conn if isinstance(m, bytes))  # after Close: only the resampler's silent end
    assert len(tail) == 0 or np.abs(np.frombuffer(tail, dtype="<i2")).max() < 50, "speech after Flushed"


def test_clear_is_a_barge_in(served_realtime: Served) -> None:
    engine = served_realtime.engine
    connect = sdk(served_realtime).speak.v1.connect
    with connect(model="aura-2-thalia-en", encoding="linear16", sample_rate="24000") as conn:
        conn.send_text(SpeakV1Text(text="This is a long answer, " * 8))
        conn.send_flush()
        for message in conn:
            if isinstance(message, bytes):
                break
        conn.send_clear()
        kinds = []
        for message in conn:
            kinds.append(kind(message))
            if kinds[-1] == "Cleared":
                break
        deadline = time.monotonic() + 5
        while not engine.cancels and time.monotonic() < deadline:
            time.sleep(0.02)
        conn.send_text(SpeakV1Text(text="Okay."))
        conn.send_flush()
        after = []
        for message in conn:
            after.append(kind(message))
            if after[-1] == "Flushed":
                break
        conn.send_close()
    assert engine.cancels, "Clear cancelled the engine work"
    assert "audio" in after and after[-1] == "Flushed"


def test_parse_query_and_messages() -> None:
    q = dg.parse_query({"model": "aura-asteria-en", "encoding": "mulaw", "seed": "3"}, ENGLISH)
    assert (q.output_format, q.seed) == (StreamFormat("raw", "mulaw", 8_000), 3)
    for bad in ({"encoding": "mp3"}, {"encoding": "mulaw", "sample_rate": "16000"}, {"container": "wav"},
                {"sample_rate": "x"}, {"model": "turbo"}):
        with pytest.raises(FieldError):
            dg.parse_query(bad, ENGLISH)
    assert dg.parse_message('{"type": "Speak", "text": "hi"}') == ("Speak", "hi")
    with pytest.raises(FieldError):
        dg.parse_message('{"type": "Shout"}')


def test_a_flush_of_a_turn_refused_busy_is_still_answered(tmp_path: Path) -> None:
    """Every slot taken: the Speak gets Warning BUSY, and its Flush its Flushed (a client that waits for Flushed
    to end a turn must not hang, nor get it later against the next turn's audio)."""
    async def scenario(served: Served) -> list[str]:
        url = served.ws + "/v1/speak?encoding=linear16&sample_rate=16000"
        async with connect(url) as hog, connect(url) as ws:
            await hog.send(json.dumps({"type": "Speak", "text": "A long answer that holds the only slot. " * 3}))
            await hog.send(json.dumps({"type": "Flush"}))
            while not isinstance(await hog.recv(), bytes):  # its audio is coming: the slot is taken
                pass
            await ws.send(json.dumps({"type": "Speak", "text": "Am I too late?"}))
            await ws.send(json.dumps({"type": "Flush"}))
            got: list[str] = []
            while "Flushed" not in got:
                message = await asyncio.wait_for(ws.recv(), 10)
                got.append("audio" if isinstance(message, bytes) else json.loads(message)["type"])
            return got

    with serving(tmp_path, max_slots=1, max_waiting=0, realtime_factor=1.0) as served:
        got = asyncio.run(scenario(served))
    assert got[-2:] == ["Warning", "Flushed"] and "audio" not in got
