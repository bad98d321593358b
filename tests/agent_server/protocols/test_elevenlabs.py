"""ElevenLabs stream-input / multi-stream-input: the unmodified `elevenlabs` SDK over wss://, and
the documented messages over `websockets` for what the SDK has no client for (multi-stream-input)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import av
import numpy as np
import pytest
from elevenlabs.client import ElevenLabs
from elevenlabs.core.api_error import ApiError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from agent_server.audio.codecs import StreamFormat
from agent_server.audio.formats import float_to_pcm16
from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.errors import FieldError
from agent_server.protocols import elevenlabs as el

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.protocols.conftest import Served, assert_length, pcm16

pytestmark = pytest.mark.timeout(60)

ENGLISH = Router(DEFAULT_ROUTES, ("english",))  # one model loaded, the built-in route table
PIECES = ["Sure, I ", "can help ", "with that. ", "Your flight ", "leaves at ", "nine ", "tomorrow."]
VOICE = "JBFqnCBsd6RMkjVDRZzb"


def sdk(served: Served) -> ElevenLabs:
    return ElevenLabs(api_key="sk-test", base_url=served.http)


# ---- the SDK, unchanged, over TLS -------------------------------------------------------------------


@pytest.mark.parametrize("output_format, rate_hz", [("pcm_16000", 16_000), ("pcm_44100", 44_100)])
def test_sdk_realtime_over_tls(served_tls: Served, output_format: str, rate_hz: int) -> None:
    audio = b"".join(
        sdk(served_tls).text_to_speech.convert_realtime(
            voice_id=VOICE, text=iter(PIECES), model_id="eleven_flash_v2_5", output_format=output_format
        )
    )
    assert_length(served_tls, len(audio), rate_hz)
    assert np.abs(pcm16(audio)).max() > 1000  # the FakeEngine's tones, not silence


def test_sdk_realtime_with_its_default_format_is_mp3(served_tls: Served) -> None:
    """`convert_realtime` without `output_format`: the vendor's default, mp3_44100_128, encoded as it comes."""
    audio = b"".join(sdk(served_tls).text_to_speech.convert_realtime(voice_id=VOICE, text=iter(PIECES)))
    with av.open(io.BytesIO(audio), "r") as container:
        stream = container.streams.audio[0]
        assert stream.codec_context.name in ("mp3", "mp3float") and stream.rate == 44_100
        seconds = sum(f.samples for f in container.decode(stream)) / stream.rate
    made_s, segments = served_tls.produced()[0] / 24_000, served_tls.produced()[1]
    assert made_s - 0.002 <= seconds <= made_s + 0.15 * segments + 0.1


def test_sdk_error_in_vendor_shape(served_tls: Served) -> None:
    with pytest.raises(ApiError) as raised:
        b"".join(sdk(served_tls).text_to_speech.convert_realtime(
            voice_id=VOICE, text=iter(["Hi there."]), output_format="pcm_12345"
        ))
    assert raised.value.status_code == 1008
    body = raised.value.body  # the error message, or the close reason when the SDK missed it (its recv race)
    assert "unsupported output_format 'pcm_12345'" in (body["message"] if isinstance(body, dict) else body)


# ---- the documented messages over websockets (multi-stream-input has no SDK client) -----------------


async def receive_all(ws: Any) -> tuple[list[dict[str, Any]], int | None]:
    messages = []
    try:
        async for raw in ws:
            messages.append(json.loads(raw))  # noqa: PERF401 (keep what came before a dropped connection)
    except ConnectionClosedError:
        pass
    return messages, ws.close_code


def audio_of(messages: list[dict[str, Any]], context_id: str | None = None) -> bytes:
    return b"".join(
        base64.b64decode(m["audio"]) for m in messages if m.get("audio") and m.get("contextId") == context_id
    )


def test_multi_stream_two_contexts_alignment_and_close_socket(served: Served) -> None:
    async def main() -> tuple[list[dict[str, Any]], int | None]:
        query = "model_id=eleven_turbo_v2_5&output_format=pcm_22050"
        url = f"{served.ws}/v1/text-to-speech/{VOICE}/multi-stream-input?{query}"
        async with connect(url) as ws:
            for cid in ("a", "b"):
                await ws.send(json.dumps({"text": " ", "context_id": cid, "voice_settings": {"stability": 0.5}}))
            for piece in PIECES:
                await ws.send(json.dumps({"text": piece, "context_id": "a"}))
                await ws.send(json.dumps({"text": piece.upper(), "context_id": "b"}))
            await ws.send(json.dumps({"text": "", "context_id": "a"}))  # a keep-alive changes nothing
            for cid in ("a", "b"):
                await ws.send(json.dumps({"context_id": cid, "flush": True}))
            await ws.send(json.dumps({"context_id": "a", "close_context": True}))  # flushed: graceful
            await ws.send(json.dumps({"text": "", "context_id": "a"}))  # Pipecat's keep-alive, still nothing
            await ws.send(json.dumps({"close_socket": True}))
            return await receive_all(ws)

    messages, close_code = asyncio.run(main())
    assert close_code == 1000
    finals = [m["contextId"] for m in messages if m.get("isFinal") is True]
    assert sorted(finals) == ["a", "b"]
    for cid, text in (("a", "".join(PIECES)), ("b", "".join(PIECES).upper())):
        final_at = next(i for i, m in enumerate(messages) if m.get("isFinal") and m["contextId"] == cid)
        assert all(m.get("contextId") == cid for m in messages if m.get("contextId") == cid)
        assert not any(m.get("audio") for m in messages[final_at:] if m.get("contextId") == cid)
        aligned = [m for m in messages if m.get("alignment") and m["contextId"] == cid]
        spoken = "".join("".join(m["alignment"]["chars"]) for m in aligned)
        assert spoken.split() == text.split()  # the whole text, one segment after another, words intact
        assert len(aligned) > 1
        end_ms = 0  # where the previous message's alignment ended, in the context's time
        for m in aligned:
            a, n = m["alignment"], m["normalizedAlignment"]
            assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
            assert n["chars"] == a["chars"] and n["charDurationsMs"] == a["charDurationsMs"]
            # alignment: from the message's start (the previous one's end); normalizedAlignment: the context's
            assert [end_ms + t for t in a["charStartTimesMs"]] == n["charStartTimesMs"]
            assert n["charStartTimesMs"][0] >= end_ms
            end_ms = n["charStartTimesMs"][-1] + n["charDurationsMs"][-1]
    total = len(audio_of(messages, "a")) + len(audio_of(messages, "b"))
    assert_length(served, total, 22_050)


def test_multi_stream_close_context_mid_turn_is_a_barge_in(served_realtime: Served) -> None:
    engine = served_realtime.engine

    async def main() -> tuple[list[dict[str, Any]], int | None]:
        url = f"{served_realtime.ws}/v1/text-to-speech/{VOICE}/multi-stream-input?output_format=pcm_16000"
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "turn1"}))
            await ws.send(json.dumps({"text": "This is a long answer, " * 8, "context_id": "turn1"}))
            while not json.loads(await ws.recv()).get("audio"):
                pass
            await ws.send(json.dumps({"context_id": "turn1", "close_context": True}))  # unflushed text: stop now
            after = []
            while True:
                message = json.loads(await ws.recv())
                after.append(message)
                if message.get("isFinal"):
                    break
            await ws.send(json.dumps({"text": " ", "context_id": "turn2"}))  # the socket carries on
            await ws.send(json.dumps({"text": "Okay.", "context_id": "turn2", "flush": True}))
            await ws.send(json.dumps({"context_id": "turn2", "close_context": True}))
            messages, _ = [], None
            while True:
                message = json.loads(await ws.recv())
                messages.append(message)
                if message.get("isFinal"):
                    break
            return after + messages, None

    messages, _ = asyncio.run(main())
    first_final = next(i for i, m in enumerate(messages) if m.get("isFinal"))
    assert messages[first_final]["contextId"] == "turn1"
    assert engine.cancels, "the engine work of the barged-in context was cancelled"
    assert all(m.get("contextId") != "turn1" for m in messages[first_final + 1 :])
    assert audio_of(messages, "turn2")


def test_multi_stream_a_late_token_after_close_context_is_that_context_s_error_only(served_realtime: Served) -> None:
    """An LLM stream still draining after the turn's close_context: the late piece is refused for that context
    (`context_closing`), the flushed turn is still spoken whole, and the socket goes on. (Audio at the pace of speech:
    the turn is still closing when the late piece arrives, however loaded the machine; a context that has ended
    frees its id.)"""
    served = served_realtime

    async def main() -> list[dict[str, Any]]:
        url = f"{served.ws}/v1/text-to-speech/{VOICE}/multi-stream-input?output_format=pcm_16000"
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "context_id": "a"}))
            await ws.send(json.dumps({"text": "Hello there friend. ", "context_id": "a", "flush": True}))
            await ws.send(json.dumps({"context_id": "a", "close_context": True}))
            await ws.send(json.dumps({"text": "late token ", "context_id": "a"}))
            await ws.send(json.dumps({"text": " ", "context_id": "b"}))
            await ws.send(json.dumps({"text": "Next turn.", "context_id": "b", "flush": True}))
            await ws.send(json.dumps({"close_socket": True}))
            messages, close_code = await receive_all(ws)
        assert close_code == 1000
        return messages

    messages = asyncio.run(main())
    [error] = [m for m in messages if "error" in m]
    assert error["error"] == "context_closing" and error["contextId"] == "a"
    assert sorted(m["contextId"] for m in messages if m.get("isFinal") is True) == ["a", "b"]
    assert [r.text.strip() for r in served.engine.submits] == ["Hello there friend.", "Next turn."]
    assert_length(served, len(audio_of(messages, "a")) + len(audio_of(messages, "b")), 16_000)


def test_stream_input_ended_before_any_text_still_says_is_final(served: Served) -> None:
    """`{"text": ""}` first (a turn the LLM had nothing for): the turn is complete, so `isFinal`, then 1000; a
    client waiting for `isFinal` to end its turn does not hang."""
    async def main() -> tuple[list[dict[str, Any]], int | None]:
        async with connect(f"{served.ws}/v1/text-to-speech/{VOICE}/stream-input?output_format=pcm_16000") as ws:
            await ws.send(json.dumps({"text": ""}))
            return await receive_all(ws)

    messages, close_code = asyncio.run(main())
    assert messages == [{"isFinal": True}] and close_code == 1000
    assert not served.engine.submits


def test_stream_input_seed_gives_the_same_bytes_under_load(served: Served) -> None:
    text = "Hello there, how are you?"

    async def one(seed: int) -> bytes:
        url = f"{served.ws}/v1/text-to-speech/{VOICE}/stream-input?output_format=pcm_24000&seed={seed}"
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " ", "xi_api_key": "sk-test"}))
            await ws.send(json.dumps({"text": text, "try_trigger_generation": True}))
            await ws.send(json.dumps({"text": ""}))
            messages, close_code = await receive_all(ws)
        assert close_code == 1000
        assert messages[-1] == {"isFinal": True}
        return audio_of(messages)

    async def main() -> list[bytes]:
        return list(await asyncio.gather(one(42), one(5), one(42), one(6)))

    a, _, b, _ = asyncio.run(main())
    assert a == b
    expected = float_to_pcm16(FakeEngine.expected_pcm(text, 42)).astype("<i2").tobytes()
    assert a == expected  # the engine's audio, bit for bit (one segment, native rate)


def test_stream_input_inactivity_timeout(served: Served) -> None:
    async def main() -> tuple[list[dict[str, Any]], int | None]:
        url = f"{served.ws}/v1/text-to-speech/{VOICE}/stream-input?output_format=ulaw_8000&inactivity_timeout=1"
        async with connect(url) as ws:
            await ws.send(json.dumps({"text": " "}))
            return await receive_all(ws)

    messages, close_code = asyncio.run(main())
    assert close_code == 1008
    assert messages[-1]["error"] == "input_timeout_exceeded"


# ---- pure ------------------------------------------------------------------------------------------


def test_output_format_is_the_vendors_with_its_default() -> None:
    """protocols/vendor_formats.elevenlabs_format (protocols/test_vendor_formats.py has every name)."""
    assert el.parse_query({}, ENGLISH).output_format == StreamFormat("mp3", "mp3", 44_100, 128_000)
    ulaw = el.parse_query({"output_format": "ulaw_8000"}, ENGLISH).output_format
    assert ulaw == StreamFormat("raw", "mulaw", 8_000)
    with pytest.raises(FieldError) as raised:
        el.parse_query({"output_format": "pcm_12345"}, ENGLISH)
    assert raised.value.field == "output_format"


def test_query_and_messages() -> None:
    q = el.parse_query({"output_format": "pcm_16000", "seed": "9", "model_id": "eleven_flash_v2_5",
                        "auto_mode": "true", "sync_alignment": "true"}, ENGLISH)
    assert (q.seed, q.auto_mode, q.inactivity_timeout_s) == (9, True, 20.0)
    with pytest.raises(FieldError, match="does not run 'turbo'"):
        el.parse_query({"output_format": "pcm_16000", "model_id": "turbo"}, ENGLISH)
    with pytest.raises(FieldError, match=r"no model this server runs speaks 'fr' \(French\)"):
        el.parse_query({"output_format": "pcm_16000", "language_code": "fr"}, ENGLISH)
    with pytest.raises(FieldError):
        el.parse_query({"output_format": "pcm_16000", "inactivity_timeout": "500"}, ENGLISH)
    m = el.parse_message('{"text": "hi ", "flush": true, "context_id": "c"}')
    assert (m.text, m.flush, m.context_id) == ("hi ", True, "c")
    for bad in ('{"text": 3}', '[1]', '{"txet": "x"}', '{"flush": "yes"}', "nope"):
        with pytest.raises(FieldError):
            el.parse_message(bad)
