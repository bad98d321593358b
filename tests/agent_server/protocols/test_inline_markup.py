"""Inline tags through the vendors that define them (agent_server/text/markup.py): ElevenLabs' and Cartesia's
`<break time=.../>` is silence of that length between the segments around it, their other tags are never
handed to the engine, and a break that cannot be played is the protocol's error."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator

import httpx
import numpy as np
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

CARTESIA_OUTPUT = {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}
PAD_PER_SEGMENT_S = 0.06


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:
        yield client


def longest_silence_s(pcm: bytes) -> float:
    samples = np.abs(np.frombuffer(pcm, dtype="<i2").astype(np.int32))
    quiet = np.concatenate(([0], (samples == 0).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(quiet))
    return float((edges[1::2] - edges[::2]).max(initial=0)) / 24_000


def test_cartesia_break_is_silence_and_tags_are_not_spoken(served: Served, http: httpx.Client) -> None:
    transcript = 'Your order is ready. <break time="1s"/> <emotion value="happy"/>It ships <spell>today</spell>.'
    response = http.post(served.http + "/tts/bytes", json={
        "model_id": "sonic-2", "transcript": transcript, "voice": {"mode": "id", "id": "default"},
        "output_format": CARTESIA_OUTPUT})
    assert response.status_code == 200, response.text
    texts = [request.text for request in served.engine.submits]
    assert [text.strip() for text in texts] == ["Your order is ready.", "It ships today."], texts
    made_samples, segments = served.produced()
    played_s = len(response.content) / 2 / 24_000
    assert made_samples / 24_000 + 1.0 <= played_s <= made_samples / 24_000 + 1.0 + segments * PAD_PER_SEGMENT_S + 0.02
    assert longest_silence_s(response.content) >= 1.0  # the pause is one stretch of silence


def test_elevenlabs_websocket_break_between_pieces(served: Served) -> None:
    async def scenario() -> tuple[bytes, list[dict[str, object]]]:
        url = served.ws + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000&sync_alignment=true"
        audio, alignments = b"", []
        async with connect(url) as ws:
            for piece in (" ", "First part. <bre", 'ak time="0.5s" /> Second part.', ""):
                await ws.send(orjson.dumps({"text": piece, "flush": piece.endswith("part.")}).decode())
            async for raw in ws:
                message = orjson.loads(raw)
                if message.get("audio"):
                    audio += base64.b64decode(message["audio"])
                if message.get("alignment"):
                    alignments.append(message["alignment"])
                if message.get("isFinal"):
                    break
        return audio, alignments

    audio, alignments = asyncio.run(scenario())
    assert all("<" not in request.text for request in served.engine.submits)
    assert longest_silence_s(audio) >= 0.5
    spoken = "".join("".join(a["chars"]) for a in alignments)  # type: ignore[arg-type]
    assert "break" not in spoken and "First part." in spoken and "Second part." in spoken


def test_a_break_that_cannot_be_played_is_an_error(served: Served, http: httpx.Client) -> None:
    response = http.post(served.http + "/tts/bytes", json={
        "model_id": "sonic-2", "transcript": 'Wait <break time="a while"/> here.',
        "voice": {"mode": "id", "id": "default"}, "output_format": CARTESIA_OUTPUT})
    assert response.status_code == 400 and "break" in response.json()["message"], response.text


def test_cartesia_flush_done_waits_for_a_break_at_the_end_of_the_flushed_text(served: Served) -> None:
    async def scenario() -> tuple[bytes, bytes]:
        request = {"context_id": "c", "model_id": "sonic-2", "voice": {"mode": "id", "id": "default"},
                   "output_format": CARTESIA_OUTPUT, "add_timestamps": True}
        before, after = b"", b""
        async with connect(served.ws + "/tts/websocket") as ws:
            await ws.send(orjson.dumps({**request, "transcript": 'Hello there. <break time="400ms"/>',
                                        "continue": True, "flush": True}).decode())
            async for raw in ws:  # the flush is done once its audio, the pause's silence included, is out
                message = orjson.loads(raw)
                assert message["type"] != "error", message
                if message["type"] == "chunk":
                    before += base64.b64decode(message["data"])
                if message["type"] == "flush_done":
                    break
            await ws.send(orjson.dumps({**request, "transcript": "Bye now.", "continue": False}).decode())
            async for raw in ws:
                message = orjson.loads(raw)
                if message["type"] == "chunk":
                    after += base64.b64decode(message["data"])
                if message.get("done"):
                    break
        return before, after

    before, after = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert longest_silence_s(before[-int(0.45 * 48_000):]) >= 0.4  # the pause ends what the flush covered
    assert after and longest_silence_s(after) < 0.4


def test_native_breaks_when_asked(served: Served) -> None:
    from tests.agent_server.native_client import NativeClient

    async def scenario() -> tuple[bytes, list[dict[str, object]], bytes, dict[str, object]]:
        client = await NativeClient.connect(served.ws + "/v1/stream")
        text = 'One moment. <break time="600ms"/> Here you go.'
        with_breaks = await client.open("a", text=text, breaks=True)
        await client.end("a")
        await asyncio.wait_for(with_breaks.finished.wait(), 20)
        as_text = await client.open("b", text='Literal <break time="600ms"/> text.')  # breaks off: it is text
        await client.end("b")
        await asyncio.wait_for(as_text.finished.wait(), 20)
        await client.open("c", text='Bad <break time="soon"/>.', breaks=True)
        error = await asyncio.wait_for(client.errors.get(), 5)
        await client.close()
        return with_breaks.audio, with_breaks.segments_done, as_text.audio, error

    audio, segments, _, error = asyncio.run(scenario())
    spoken = ["".join(s["alignment"]["chars"]).strip() for s in segments]  # type: ignore[index]
    assert spoken == ["One moment.", "", "Here you go."]
    assert abs(float(segments[1]["audio_ms"]) - 600) < 1  # type: ignore[arg-type]
    assert longest_silence_s(audio) >= 0.6
    assert any("<break" in request.text for request in served.engine.submits)  # context b: spoken as written
    assert error["field"] == "text" and error["code"] == "bad_markup" and error["context_id"] == "c"
