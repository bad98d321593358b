"""Telephony wire formats: jambonz's custom TTS API (compat/jambonz.py) and Twilio Media Streams
(compat/twilio.py). The tests play the other side with the messages those platforms document."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import numpy.typing as npt
import orjson
import pytest

from agent_server.audio import mulaw_to_pcm16
from agent_server.codecs import StreamFormat, make_encoder
from agent_server.compat import jambonz, twilio
from agent_server.compat.common import CompatError


def speech(seconds: float) -> npt.NDArray[np.float32]:
    t = np.arange(int(seconds * 24_000)) / 24_000
    out: npt.NDArray[np.float32] = (0.4 * np.sin(2 * np.pi * 300 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    return out


# ---- jambonz: HTTP ----------------------------------------------------------------------------------


def test_jambonz_http_default_is_mp3_it_can_decode() -> None:
    # what mod_custom_tts sends: {"text", "type", "language", "voice"} with Accept: audio/mpeg
    req = jambonz.parse_http({"text": "Hello caller.", "type": "text", "language": "en-US", "voice": "v1"}, "audio/mpeg")
    assert req.output == StreamFormat("mp3", "mp3", 24_000, 64_000) and req.content_type == "audio/mpeg"
    enc = make_encoder(req.output)
    data = b"".join(enc.push(speech(1.0)) + enc.finish())
    with av.open(io.BytesIO(data), "r") as container:
        assert container.streams.audio[0].codec_context.name in ("mp3", "mp3float")


@pytest.mark.parametrize(("accept", "expected", "content_type"), [
    (None, StreamFormat("mp3", "mp3", 24_000, 64_000), "audio/mpeg"),
    ("*/*", StreamFormat("mp3", "mp3", 24_000, 64_000), "audio/mpeg"),
    ("audio/mp3", StreamFormat("mp3", "mp3", 24_000, 64_000), "audio/mpeg"),
    ("audio/x-wav", StreamFormat("wav", "pcm_s16le", 24_000), "audio/wav"),
    ("audio/l16;rate=8000", StreamFormat("raw", "pcm_s16le", 8_000), "audio/l16;rate=8000"),
    ("text/html, audio/L16; rate=16000", StreamFormat("raw", "pcm_s16le", 16_000), "audio/l16;rate=16000"),
])
def test_jambonz_http_accept(accept: str | None, expected: StreamFormat, content_type: str) -> None:
    assert jambonz.http_format(accept) == (expected, content_type)


def test_jambonz_ssml_speaks_its_text() -> None:
    req = jambonz.parse_http({"text": '<speak>Hello <break time="300ms"/> <emphasis>there</emphasis>.</speak>',
                              "type": "ssml"}, None)
    assert req.text == "Hello there ."


@pytest.mark.parametrize(("body", "accept", "field"), [
    ({"text": ""}, None, "text"),
    ({"text": "hi", "type": "markdown"}, None, "type"),
    ({"text": "<speak>hi", "type": "ssml"}, None, "text"),
    ({"text": "<speak><break/></speak>", "type": "ssml"}, None, "text"),
    ({"text": "hi", "voice": 3}, None, "voice"),
    ({"text": "hi", "gender": "f"}, None, "gender"),
    ({"text": "hi"}, "audio/ogg", "accept"),
    ({"text": "hi"}, "audio/l16", "accept"),
    ({"text": "hi"}, "audio/l16;rate=11025", "accept"),
])
def test_jambonz_http_refusals(body: dict[str, object], accept: str | None, field: str) -> None:
    with pytest.raises(CompatError) as exc:
        jambonz.parse_http(body, accept)
    assert exc.value.field == field
    assert jambonz.http_error_body(exc.value.message) == {"error": exc.value.message}


# ---- jambonz: WebSocket -----------------------------------------------------------------------------


def test_jambonz_stream_session_as_jambonz_drives_it() -> None:
    query = jambonz.parse_query({"voice": "Xb7hH8MSUJpSbSDYk0k2", "language": "en", "sampleRate": "16000"})
    assert orjson.loads(jambonz.connect_message(query)) == {"type": "connect", "data": {"sample_rate": 16_000, "base64_encoding": False}}
    script = ['{"type":"stream","text":"Hello, "}', '{"type":"stream","text":"how can I help?"}', '{"type":"flush"}',
              '{"type":"keepalive"}', '{"type":"stop"}']
    messages = [jambonz.parse_message(raw) for raw in script]
    assert [m.kind for m in messages] == ["stream", "stream", "flush", "keepalive", "stop"]
    assert "".join(m.text for m in messages) == "Hello, how can I help?"
    enc = make_encoder(query.output)  # binary frames: PCM16 LE at the asked rate
    audio = b"".join(enc.push(speech(0.5)) + enc.finish())
    assert len(audio) == 16_000 * 2 // 2


@pytest.mark.parametrize(("raw", "field"), [
    ("nope", "message"), (b"\x00\x01", "message"), ('{"type":"speak","text":"x"}', "type"),
    ('{"type":"stream","text":5}', "text"), ('{"type":"flush","text":"x"}', "text"),
    ('{"type":"stream","text":"x","voice":"v"}', "voice"),
])
def test_jambonz_bad_messages(raw: str | bytes, field: str) -> None:
    with pytest.raises(CompatError) as exc:
        jambonz.parse_message(raw)
    assert exc.value.field == field
    assert orjson.loads(jambonz.error_message(exc.value.message)) == {"type": "error", "error": exc.value.message}


def test_jambonz_query() -> None:
    assert jambonz.parse_query({}).output == StreamFormat("raw", "pcm_s16le", 8_000)
    for bad in ("11025", "abc", "-8000"):
        with pytest.raises(CompatError) as exc:
            jambonz.parse_query({"sampleRate": bad})
        assert exc.value.field == "sampleRate"


# ---- Twilio -----------------------------------------------------------------------------------------

START = {"event": "start", "sequenceNumber": "1", "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0",
         "start": {"accountSid": "AC123", "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0", "callSid": "CA123",
                   "tracks": ["inbound"], "customParameters": {"context": "greeting"},
                   "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}}


def test_twilio_call_with_marks_and_a_barge_in() -> None:
    """Twilio's side: connected, start; our audio goes out as 20 ms media frames with a mark after each
    segment; Twilio echoes the first mark (played), the bridge clears, Twilio echoes the rest (dropped)."""
    assert twilio.parse_incoming('{"event":"connected","protocol":"Call","version":"1.0.0"}').event == "connected"
    start = twilio.parse_incoming(orjson.dumps(START))
    assert (start.stream_sid, start.call_sid, dict(start.custom_parameters)) == (START["streamSid"], "CA123", {"context": "greeting"})
    playout = twilio.TwilioPlayout(start.stream_sid)
    enc = make_encoder(twilio.TWILIO_FORMAT)
    out: list[str] = []
    for index, seconds in enumerate((0.5, 0.3)):
        out += playout.media(enc.push(speech(seconds)) + enc.drain())
        out += [playout.segment_end("t1", index)]
    sent = [orjson.loads(m) for m in out]
    media = [m for m in sent if m["event"] == "media"]
    marks = [m for m in sent if m["event"] == "mark"]
    assert all(m["streamSid"] == START["streamSid"] and set(m) == {"event", "streamSid", "media"} for m in media)
    frames = [base64.b64decode(m["media"]["payload"]) for m in media]
    assert all(len(f) == 160 for f in frames)  # 20 ms of mu-law at 8 kHz
    assert [m["mark"]["name"] for m in marks] == ["t1:0", "t1:1"] and sent[-1]["event"] == "mark"
    heard = mulaw_to_pcm16(np.frombuffer(b"".join(frames), np.uint8)).astype(np.float64)
    ref_enc = make_encoder(StreamFormat("raw", "pcm_s16le", 8_000, frame_ms=20))
    ref = b"".join(ref_enc.push(speech(0.5)) + ref_enc.drain() + ref_enc.push(speech(0.3)) + ref_enc.drain())
    expected = np.frombuffer(ref, "<i2").astype(np.float64)
    assert len(heard) == len(expected)
    snr_db = 10 * np.log10(np.sum(expected**2) / np.sum((heard - expected) ** 2))
    assert snr_db > 30  # the caller hears our audio, through G.711's quantisation only
    echo = {"event": "mark", "sequenceNumber": "40", "streamSid": START["streamSid"], "mark": {"name": "t1:0"}}
    assert playout.on_mark(twilio.parse_incoming(orjson.dumps(echo)).mark_name) is True
    barge = twilio.parse_incoming(orjson.dumps({"event": "clear", "streamSid": START["streamSid"]}))
    assert barge.event == "clear"
    assert orjson.loads(playout.clear()) == {"event": "clear", "streamSid": START["streamSid"]}
    after = playout.segment_end("t2", 0)  # the next turn's mark, sent before the dropped echo comes back
    assert playout.on_mark("t1:1") is False
    assert orjson.loads(after)["mark"]["name"] == "t2:0" and playout.on_mark("t2:0") is True
    assert (playout.played_marks, playout.cleared_marks) == (["t1:0", "t2:0"], ["t1:1"])


def test_twilio_media_and_stop_and_dtmf() -> None:
    payload = base64.b64encode(bytes(range(160))).decode()
    media = twilio.parse_incoming(orjson.dumps({"event": "media", "sequenceNumber": "3", "streamSid": "MZ1",
                                                "media": {"track": "inbound", "chunk": "1", "timestamp": "5",
                                                          "payload": payload}}))
    assert media.payload == bytes(range(160))
    dtmf = twilio.parse_incoming('{"event":"dtmf","streamSid":"MZ1","sequenceNumber":"5","dtmf":{"track":"inbound_track","digit":"1"}}')
    assert dtmf.digit == "1"
    stop = twilio.parse_incoming('{"event":"stop","sequenceNumber":"5","streamSid":"MZ1","stop":{"accountSid":"AC1","callSid":"CA1"}}')
    assert stop.event == "stop"


@pytest.mark.parametrize(("raw", "field"), [
    ('{"event":"hello","streamSid":"MZ1"}', "event"),
    ('{"event":"media","media":{"payload":""}}', "streamSid"),
    ('{"event":"media","streamSid":"MZ1","media":{"payload":"@@@"}}', "media.payload"),
    ('{"event":"mark","streamSid":"MZ1","mark":{}}', "mark.name"),
    ('{"event":"start","streamSid":"MZ1","start":{"mediaFormat":{"encoding":"audio/l16","sampleRate":16000}}}', "start.mediaFormat"),
    ('{"event":"start","streamSid":"MZ1","start":{"customParameters":{"a":1}}}', "start.customParameters"),
    ('{"event":"start","streamSid":"MZ1"}', "start"),
    ('{"event":"clear","streamSid":"MZ1","extra":1}', "extra"),
])
def test_twilio_bad_messages(raw: str, field: str) -> None:
    with pytest.raises(CompatError) as exc:
        twilio.parse_incoming(raw)
    assert exc.value.field == field


def test_twilio_unknown_or_out_of_order_mark_is_refused() -> None:
    playout = twilio.TwilioPlayout("MZ1")
    playout.segment_end("t", 0)
    playout.segment_end("t", 1)
    with pytest.raises(CompatError):
        playout.on_mark("t:1")
    with pytest.raises(CompatError):
        playout.on_mark("other")
    assert playout.on_mark("t:0") and playout.on_mark("t:1")
    with pytest.raises(CompatError):
        playout.on_mark("t:1")
