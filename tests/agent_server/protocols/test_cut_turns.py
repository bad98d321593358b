"""A turn cut short (the shutdown's grace ran out under it) never looks complete: an HTTP response whose audio
started is cut without the body's end, so the client's HTTP library reports an incomplete response instead of
handing over a short file; ElevenLabs' stream-input gets an error and 1001, not `isFinal`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.agent_server.protocols.conftest import Served

pytestmark = pytest.mark.timeout(60)

LONG = "This answer goes on for a while, sentence after sentence, so that it is still speaking. " * 6


def drain_soon(served: Served, grace_s: float = 0.3) -> None:
    hub = served.live.hub
    hub.post(lambda: asyncio.ensure_future(hub.drain(grace_s)))


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": LONG, "response_format": "pcm"}),
    ("/v1/text-to-speech/default/stream?output_format=pcm_24000", {"text": LONG}),
], ids=["openai", "elevenlabs"])
def test_an_http_response_cut_by_the_shutdown_is_incomplete(served_realtime: Served, path: str,
                                                              body: dict[str, Any]) -> None:
    got = 0
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
            "POST", served_realtime.http + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            if not got:
                drain_soon(served_realtime)
            got += len(chunk)
    assert got > 0


def test_elevenlabs_stream_input_cut_by_the_shutdown_is_an_error_not_final(served_realtime: Served) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def scenario() -> tuple[list[dict[str, Any]], int | None]:
        url = served_realtime.ws + "/v1/text-to-speech/default/stream-input?output_format=pcm_16000"
        messages: list[dict[str, Any]] = []
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " "}))
            await ws.send(json.dumps({"text": LONG, "flush": True}))
            try:
                async for raw in ws:
                    messages.append(json.loads(raw))
                    if len(messages) == 1:
                        drain_soon(served_realtime)
            except ConnectionClosed:
                pass
            return messages, ws.close_code

    messages, code = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert code == 1001
    assert not any(m.get("isFinal") for m in messages)
    assert messages[-1]["error"] == "shutting_down"
