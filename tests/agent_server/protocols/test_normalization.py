"""Text normalisation through the protocols (agent_server/text/normalize/): every vendor's client gets numbers,
money and times said as words by default, as from the hosted APIs; ElevenLabs' `apply_text_normalization: "off"`
and the native `normalize: false` give the engine the text as written; the alignment a client gets is on the
characters it sent either way."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.agent_server.native_client import NativeClient
from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

TEXT = "Your order of $42.50 ships at 9:30 am."
SAID = "Your order of forty-two dollars and fifty cents ships at nine thirty a m."


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30.0) as client:
        yield client


def heard(served: Served) -> str:
    return " ".join(request.text for request in served.engine.submits)


@pytest.mark.parametrize("normalization", [None, "auto", "on", "off"])
def test_elevenlabs_apply_text_normalization(served: Served, http: httpx.Client, normalization: str | None) -> None:
    from elevenlabs import ElevenLabs

    client = ElevenLabs(api_key="sk-test", base_url=served.http, httpx_client=http)
    extra: dict[str, Any] = {} if normalization is None else {"apply_text_normalization": normalization}
    answer = client.text_to_speech.convert_with_timestamps("default", text=TEXT, output_format="pcm_24000", **extra)
    assert heard(served) == (TEXT if normalization == "off" else SAID)
    assert answer.alignment is not None
    assert "".join(answer.alignment.characters).strip() == TEXT  # the client's characters, each with a time
    starts = answer.alignment.character_start_times_seconds
    assert starts == sorted(starts)


def test_elevenlabs_websocket_query_switches_it_off_and_a_bad_value_is_refused(served: Served) -> None:
    import orjson
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def scenario(query: str) -> list[dict[str, Any]]:
        url = served.ws + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000" + query
        messages = []
        async with connect(url) as ws:
            try:
                await ws.send(orjson.dumps({"text": " "}).decode())
                await ws.send(orjson.dumps({"text": TEXT, "flush": True}).decode())
                await ws.send(orjson.dumps({"text": ""}).decode())
            except ConnectionClosed:
                pass  # refused: what the server said before closing is still read below
            try:
                async for raw in ws:
                    messages.append(orjson.loads(raw))
                    if messages[-1].get("isFinal"):
                        break
            except ConnectionClosed:  # a refusal closes with 1008 after its error message
                pass
        return messages

    spoken = asyncio.run(asyncio.wait_for(scenario("&apply_text_normalization=off"), 20))
    assert spoken[-1].get("isFinal") and heard(served) == TEXT
    served.engine.submits.clear()
    [refusal] = asyncio.run(asyncio.wait_for(scenario("&apply_text_normalization=sometimes"), 20))
    assert refusal["error"] == "invalid_apply_text_normalization" and "auto, on, off" in refusal["message"]
    assert not served.engine.submits


def test_openai_deepgram_and_cartesia_say_the_words(served: Served, http: httpx.Client) -> None:
    import openai

    with openai.OpenAI(api_key="sk-test", base_url=served.http + "/v1", max_retries=0) as client:
        client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm")
    assert heard(served) == SAID
    served.engine.submits.clear()
    response = http.post(served.http + "/v1/speak?encoding=linear16&container=none", json={"text": TEXT},
                         headers={"Authorization": "Token dg-test"})
    assert response.status_code == 200 and heard(served) == SAID
    served.engine.submits.clear()
    request = {"model_id": "sonic-2", "transcript": TEXT, "voice": {"mode": "id", "id": "default"},
               "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 24_000}}
    response = http.post(served.http + "/tts/bytes", json=request, headers={"Cartesia-Version": "2025-04-16"})
    assert response.status_code == 200 and heard(served) == SAID


@pytest.mark.parametrize("normalize", [True, False])
def test_native_normalize(served: Served, normalize: bool) -> None:
    async def scenario() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        client = await NativeClient.connect(served.ws + "/v1/stream")
        log = await client.open("c", text=TEXT, normalize=normalize)
        await client.end("c")
        await asyncio.wait_for(log.finished.wait(), 20)
        await client.open("bad", normalize="yes")
        error = await asyncio.wait_for(client.errors.get(), 5)
        await client.close()
        return log.segments_done, error

    segments, error = asyncio.run(scenario())
    assert heard(served) == (SAID if normalize else TEXT)
    assert " ".join("".join(seg["alignment"]["chars"]).strip() for seg in segments) == TEXT
    assert error["field"] == "normalize" and error["context_id"] == "bad"
