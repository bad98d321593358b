"""Telephony: jambonz's custom TTS API (protocols/jambonz.py, HTTP and WebSocket) and Twilio Media Streams
(protocols/twilio.py, the native protocol's Twilio output mode). The tests play the other side with the
messages those platforms document, against a real server where it matters."""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import av
import httpx
import numpy as np
import numpy.typing as npt
import orjson
import pytest
from websockets.exceptions import ConnectionClosedOK
from websockets.sync.client import connect as ws_connect

from agent_server.audio.codecs import StreamFormat, make_encoder
from agent_server.audio.formats import mulaw_to_pcm16
from agent_server.errors import FieldError
from agent_server.protocols import jambonz, twilio

from tests.agent_server.protocols.conftest import Served, assert_length


def speech(seconds: float) -> npt.NDArray[np.float32]:
    t = np.arange(int(seconds * 24_000)) / 24_000
    tone = 0.4 * np.sin(2 * np.pi * 300 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    out: npt.NDArray[np.float32] = tone.astype(np.float32)
    return out


# ---- jambonz: HTTP ----------------------------------------------------------------------------------


def test_jambonz_http_default_is_mp3_it_can_decode() -> None:
    # what mod_custom_tts sends: {"text", "type", "language", "voice"} with Accept: audio/mpeg
    body = {"text": "Hello caller.", "type": "text", "language": "en-US", "voice": "v1"}
    req = jambonz.parse_http(body, "audio/mpeg")
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
    ("audio/wav;q=0.5, audio/mpeg;q=1", StreamFormat("mp3", "mp3", 24_000, 64_000), "audio/mpeg"),  # q decides
    ("audio/mpeg;q=0, audio/l16;rate=8000;q=0.2", StreamFormat("raw", "pcm_s16le", 8_000), "audio/l16;rate=8000"),
])
def test_jambonz_http_accept(accept: str | None, expected: StreamFormat, content_type: str) -> None:
    assert jambonz.http_format(accept) == (expected, content_type)


def test_jambonz_ssml_speaks_its_text() -> None:
    req = jambonz.parse_http({"text": '<speak>Hello <break time="300ms"/> <emphasis>there</emphasis>.</speak>',
                              "type": "ssml"}, None)
    assert req.text == 'Hello <break time="300ms"/> there.' and req.ssml
    strong = jambonz.parse_http({"text": '<speak>A<break strength="strong"/>B<break strength="none"/>C</speak>',
                                 "type": "ssml"}, None)
    assert strong.text == 'A <break time="700ms"/> B C'


@pytest.mark.parametrize(("body", "accept", "field"), [
    ({"text": ""}, None, "text"),
    ({"text": "hi", "type": "markdown"}, None, "type"),
    ({"text": "<speak>hi", "type": "ssml"}, None, "text"),
    ({"text": "<speak> <emphasis/> </speak>", "type": "ssml"}, None, "text"),
    ({"text": '<speak><break strength="none"/></speak>', "type": "ssml"}, None, "text"),
    ({"text": '<speak>hi <break strength="huge"/></speak>', "type": "ssml"}, None, "text"),
    ({"text": "hi", "voice": 3}, None, "voice"),
    ({"text": "hi", "gender": "f"}, None, "gender"),
    ({"text": "hi"}, "audio/ogg", "accept"),
    ({"text": "hi"}, "audio/l16", "accept"),
    ({"text": "hi"}, "audio/l16;rate=11025", "accept"),
])
def test_jambonz_http_refusals(body: dict[str, object], accept: str | None, field: str) -> None:
    with pytest.raises(FieldError) as exc:
        jambonz.parse_http(body, accept)
    assert exc.value.field == field
    assert jambonz.http_error_body(exc.value.message) == {"error": exc.value.message, "code": "bad_request"}


# ---- jambonz: WebSocket -----------------------------------------------------------------------------


def test_jambonz_stream_session_as_jambonz_drives_it() -> None:
    query = jambonz.parse_query({"voice": "Xb7hH8MSUJpSbSDYk0k2", "language": "en", "sampleRate": "16000"})
    connect = {"type": "connect", "data": {"sample_rate": 16_000, "base64_encoding": False}}
    assert orjson.loads(jambonz.connect_message(query)) == connect
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
    with pytest.raises(FieldError) as exc:
        jambonz.parse_message(raw)
    assert exc.value.field == field
    assert orjson.loads(jambonz.error_message(exc.value.message)) == {"type": "error", "error": exc.value.message,
                                                                    "code": "bad_request"}


def test_jambonz_query() -> None:
    assert jambonz.parse_query({}).output == StreamFormat("raw", "pcm_s16le", 8_000)
    for bad in ("11025", "abc", "-8000"):
        with pytest.raises(FieldError) as exc:
            jambonz.parse_query({"sampleRate": bad})
        assert exc.value.field == "sampleRate"
    assert jambonz.parse_query({"seed": "5"}).seed == 5 and jambonz.parse_query({}).seed is None  # our extension
    for bad in ("x", "-1", "1.5", "¹"):
        with pytest.raises(FieldError) as exc:
            jambonz.parse_query({"seed": bad})
        assert exc.value.field == "seed"


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
    started = (START["streamSid"], "CA123", {"context": "greeting"})
    assert (start.stream_sid, start.call_sid, dict(start.custom_parameters)) == started
    playout = twilio.TwilioPlayout(start.stream_sid)
    enc = make_encoder(twilio.TWILIO_FORMAT)
    out: list[str] = []
    for index, seconds in enumerate((0.5, 0.3)):
        out += [playout.media(frame) for frame in enc.push(speech(seconds)) + enc.drain()]
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
    assert not playout.pending_marks


def test_twilio_media_and_stop_and_dtmf() -> None:
    payload = base64.b64encode(bytes(range(160))).decode()
    media = twilio.parse_incoming(orjson.dumps({"event": "media", "sequenceNumber": "3", "streamSid": "MZ1",
                                                "media": {"track": "inbound", "chunk": "1", "timestamp": "5",
                                                          "payload": payload}}))
    assert media.payload == bytes(range(160))
    dtmf = twilio.parse_incoming('{"event":"dtmf","streamSid":"MZ1","sequenceNumber":"5",'
                                 '"dtmf":{"track":"inbound_track","digit":"1"}}')
    assert dtmf.digit == "1"
    stop = twilio.parse_incoming('{"event":"stop","sequenceNumber":"5","streamSid":"MZ1",'
                                 '"stop":{"accountSid":"AC1","callSid":"CA1"}}')
    assert stop.event == "stop"


@pytest.mark.parametrize(("raw", "field"), [
    ('{"event":"hello","streamSid":"MZ1"}', "event"),
    ('{"event":"media","media":{"payload":""}}', "streamSid"),
    ('{"event":"media","streamSid":"MZ1","media":{"payload":"@@@"}}', "media.payload"),
    ('{"event":"mark","streamSid":"MZ1","mark":{}}', "mark.name"),
    ('{"event":"start","streamSid":"MZ1","start":{"mediaFormat":{"encoding":"audio/l16","sampleRate":16000}}}',
     "start.mediaFormat"),
    ('{"event":"start","streamSid":"MZ1","start":{"customParameters":{"a":1}}}', "start.customParameters"),
    ('{"event":"start","streamSid":"MZ1"}', "start"),
    ('{"event":"clear","streamSid":"MZ1","extra":1}', "extra"),
])
def test_twilio_bad_messages(raw: str, field: str) -> None:
    with pytest.raises(FieldError) as exc:
        twilio.parse_incoming(raw)
    assert exc.value.field == field


def test_twilio_unknown_or_out_of_order_mark_is_refused() -> None:
    playout = twilio.TwilioPlayout("MZ1")
    playout.segment_end("t", 0)
    playout.segment_end("t", 1)
    with pytest.raises(FieldError):
        playout.on_mark("t:1")
    with pytest.raises(FieldError):
        playout.on_mark("other")
    assert playout.on_mark("t:0") and playout.on_mark("t:1")
    with pytest.raises(FieldError):
        playout.on_mark("t:1")


# ---- Twilio output mode of the native protocol, over a real server ------------------------------------------

STREAM_SID = "MZ18ad3ab5a668481ce02b83e7395059f0"
LONG_TURN = "Thanks for calling. Let me look that up for you. It will take a moment. Please stay on the line. " * 2


def test_twilio_mode_media_marks_and_a_barge_in(served_realtime: Served) -> None:
    """The test is the bridge and plays Twilio: every message with an `event` goes to "Twilio" untouched.
    Twilio plays the first segment and echoes its mark; the bridge then barges in (`clear`), so Twilio
    echoes the marks still pending at once: the server reports them as dropped, cancels the context (the
    engine stops) and sends the `clear` for Twilio. A second turn on the same call plays to its end."""
    engine = served_realtime.engine
    with ws_connect(served_realtime.ws + "/v1/stream") as ws:
        assert json_of(ws.recv(timeout=10))["type"] == "session_started"
        send_json(ws, {"type": "open", "context_id": "t1", "twilio": {"stream_sid": STREAM_SID}, "text": LONG_TURN})
        send_json(ws, {"type": "end", "context_id": "t1"})
        to_twilio: list[dict[str, Any]] = []
        reports: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        held_marks: list[str] = []
        cleared = False
        while not any(e.get("type") == "context_done" for e in events):
            message = json_of(ws.recv(timeout=10))
            if "event" in message:
                to_twilio.append(message)
                if message["event"] == "mark":
                    if not reports and not held_marks:
                        send_json(ws, twilio_echo(message["mark"]["name"]))  # Twilio played segment 0
                    else:
                        held_marks.append(message["mark"]["name"])  # still playing when the caller speaks
            elif message["type"] == "twilio_mark":
                reports.append(message)
                if not cleared:
                    assert message["played"] and message["name"] == "t1:0"
                    send_json(ws, {"event": "clear", "streamSid": STREAM_SID})  # the caller barges in
                    cleared = True
            else:
                events.append(message)
        assert next(e for e in events if e["type"] == "context_done")["reason"] == "cancelled"
        assert engine.cancels, "the barge-in stopped the engine's work on the turn"
        for name in held_marks:  # Twilio echoes the marks a clear dropped at once
            send_json(ws, twilio_echo(name))
        while len(reports) < 1 + len(held_marks):
            message = json_of(ws.recv(timeout=10))
            if message.get("type") == "twilio_mark":
                reports.append(message)
        assert [r["played"] for r in reports] == [True] + [False] * len(held_marks)
        clears = [m for m in to_twilio if m["event"] == "clear"]
        assert clears == [{"event": "clear", "streamSid": STREAM_SID}]
        media = [m for m in to_twilio if m["event"] == "media"]
        assert media and all(m["streamSid"] == STREAM_SID and set(m) == {"event", "streamSid", "media"}
                             for m in media)
        assert all(len(base64.b64decode(m["media"]["payload"])) == 160 for m in media)  # 20 ms of mu-law
        assert to_twilio.index(clears[0]) > to_twilio.index(media[-1])  # nothing of the turn after the clear

        send_json(ws, {"type": "open", "context_id": "t2", "twilio": {"stream_sid": STREAM_SID},
                       "text": "Sure, go ahead."})
        send_json(ws, {"type": "end", "context_id": "t2"})
        marks, done = [], None
        while done is None:
            message = json_of(ws.recv(timeout=10))
            if message.get("event") == "mark":
                marks.append(message["mark"]["name"])
                send_json(ws, twilio_echo(message["mark"]["name"]))
            elif message.get("type") == "context_done":
                done = message
        assert done["reason"] == "completed" and marks == [f"t2:{i}" for i in range(done["segments"])]
        played: list[tuple[str, int, bool]] = []
        while len(played) < len(marks):
            message = json_of(ws.recv(timeout=10))
            if message.get("type") == "twilio_mark":
                played.append((message["context_id"], message["segment_index"], message["played"]))
        assert played == [("t2", i, True) for i in range(len(marks))]


def test_twilio_mode_refusals(served: Served) -> None:
    with ws_connect(served.ws + "/v1/stream") as ws:
        assert json_of(ws.recv(timeout=10))["type"] == "session_started"
        send_json(ws, {"type": "open", "context_id": "a", "twilio": {"stream_sid": "MZ1"},
                       "output_format": {"encoding": "pcm_s16le", "sample_rate_hz": 16_000}})
        assert json_of(ws.recv(timeout=10))["field"] == "output_format"
        send_json(ws, {"type": "open", "context_id": "a", "twilio": {"sid": "MZ1"}})
        assert json_of(ws.recv(timeout=10))["field"] == "twilio"
        send_json(ws, twilio_echo("a:0"))  # a mark of a stream nothing played on
        assert json_of(ws.recv(timeout=10))["code"] == "unknown_stream"
        for call in range(40):  # more than max_protocol_errors: calls that ended (or were cleared) before the
            sid = f"MZcall{call:04d}"  # agent spoke are no errors, and the socket serves the other calls on
            send_json(ws, {"event": "start", "streamSid": sid, "start": {"streamSid": sid, "callSid": "CA1"}})
            send_json(ws, {"event": "clear", "streamSid": sid})
            send_json(ws, {"event": "stop", "streamSid": sid, "stop": {"accountSid": "AC1", "callSid": "CA1"}})
        send_json(ws, {"event": "media", "streamSid": "MZ9", "media": {"payload": "AAAA"}})  # the caller's audio
        send_json(ws, {"type": "keepalive"})
        send_json(ws, {"event": "mark", "streamSid": "MZ9"})  # malformed
        assert json_of(ws.recv(timeout=10))["field"] == "mark"  # (the media message got no answer)


def test_twilio_pending_marks_are_bounded_and_a_clear_still_reads_them() -> None:
    """A bridge that never forwards the echoes: the stream keeps the newest MAX_PENDING_MARKS marks."""
    playout = twilio.TwilioPlayout("MZ1")
    for index in range(twilio.MAX_PENDING_MARKS + 10):
        playout.segment_end("t", index)
    assert len(playout.pending_marks) == twilio.MAX_PENDING_MARKS and playout.pending_marks[0] == "t:10"
    playout.clear()
    playout.segment_end("t", twilio.MAX_PENDING_MARKS + 10)  # after the clear, pushing one dropped mark out
    assert playout.dropped_pending == twilio.MAX_PENDING_MARKS - 1
    echoes = [playout.on_mark(name) for name in list(playout.pending_marks)]
    assert echoes == [False] * (twilio.MAX_PENDING_MARKS - 1) + [True]


def twilio_echo(name: str) -> dict[str, Any]:
    return {"event": "mark", "sequenceNumber": "9", "streamSid": STREAM_SID, "mark": {"name": name}}


def json_of(raw: str | bytes) -> dict[str, Any]:
    assert isinstance(raw, str), "a Twilio context's audio comes as text messages"
    message: dict[str, Any] = orjson.loads(raw)
    return message


def send_json(ws: Any, body: dict[str, Any]) -> None:
    ws.send(orjson.dumps(body).decode())


# ---- jambonz over a real server ---------------------------------------------------------------------------

JAMBONZ_TEXT = "Hello caller, thanks for waiting. Your order has shipped."


@pytest.mark.parametrize(("accept", "content_type"), [(None, "audio/mpeg"), ("audio/mpeg", "audio/mpeg"),
                                                      ("audio/wav", "audio/wav")])
def test_jambonz_http_as_jambonz_posts(served: Served, accept: str | None, content_type: str) -> None:
    headers = {"authorization": "Bearer jambonz-key"} | ({"accept": accept} if accept else {})
    body = {"text": JAMBONZ_TEXT, "type": "text", "language": "en-US", "voice": "custom-voice"}
    with httpx.Client(timeout=30.0) as http:
        response = http.post(served.http + "/v1/jambonz/tts", json=body, headers=headers)
    assert response.status_code == 200 and response.headers["content-type"] == content_type
    with av.open(io.BytesIO(response.content), "r") as container:
        stream = container.streams.audio[0]
        seconds = sum(f.samples for f in container.decode(stream)) / stream.rate
    made_s = served.produced()[0] / 24_000
    assert made_s - 0.002 <= seconds <= made_s + 0.15 * served.produced()[1] + 0.1


def test_jambonz_http_l16_and_ssml(served: Served) -> None:
    body = {"text": "<speak>Hello <break time='200ms'/> caller.</speak>", "type": "ssml"}
    with httpx.Client(timeout=30.0) as http:
        response = http.post(served.http + "/v1/jambonz/tts", json=body, headers={"accept": "audio/l16;rate=8000"})
        assert response.status_code == 200 and response.headers["content-type"] == "audio/l16;rate=8000"
        assert [r.text.strip() for r in served.engine.submits] == ["Hello", "caller."]  # a pause between
        assert_length(served, len(response.content) - 2 * 1_600, 8_000)  # the break: 200 ms of silence at 8 kHz
        refused = http.post(served.http + "/v1/jambonz/tts", json={"text": "<speak>Hi", "type": "ssml"})
    assert refused.status_code == 400 and "SSML" in refused.json()["error"]


def test_jambonz_ssml_of_a_break_alone_is_that_much_silence(served: Served) -> None:
    """A prompt's pause (`<speak><break time="500ms"/></speak>`): 200 and half a second of silence, no engine work."""
    body = {"text": '<speak><break time="500ms"/></speak>', "type": "ssml"}
    with httpx.Client(timeout=30.0) as http:
        response = http.post(served.http + "/v1/jambonz/tts", json=body, headers={"accept": "audio/l16;rate=8000"})
    assert response.status_code == 200 and response.headers["content-type"] == "audio/l16;rate=8000"
    assert 4_000 <= len(response.content) // 2 <= 4_000 + 800 and not response.content.strip(b"\x00")  # (+ the
    # resampler's flush: at most 0.1 s)
    assert served.engine.submits == []


def test_jambonz_stream_as_jambonz_drives_it(served_realtime: Served) -> None:
    """jambonz connects with its query, waits for `connect`, streams text pieces, flushes, and gets binary
    PCM16 at the rate it asked for; `stop` (the caller barged in) drops the rest and ends the connection."""
    engine = served_realtime.engine
    url = served_realtime.ws + "/v1/jambonz/stream?voice=Xb7hH8MSUJpSbSDYk0k2&language=en-US&sampleRate=16000"
    with ws_connect(url) as ws:
        assert json_of(ws.recv(timeout=10)) == {"type": "connect", "data": {"sample_rate": 16_000,
                                                                            "base64_encoding": False}}
        for piece in ("Hello, ", "how can I ", "help you today? "):
            send_json(ws, {"type": "stream", "text": piece})
        send_json(ws, {"type": "flush"})
        audio = b""
        while len(audio) < 16_000:  # half a second of the first turn
            frame = ws.recv(timeout=10)
            assert isinstance(frame, bytes)
            audio += frame
        send_json(ws, {"type": "keepalive"})
        send_json(ws, {"type": "stream", "text": "And a much longer second turn follows here, on and on. " * 3})
        send_json(ws, {"type": "flush"})
        send_json(ws, {"type": "stop"})
        with pytest.raises(ConnectionClosedOK):
            while True:
                ws.recv(timeout=10)
        assert ws.close_code == 1000
    assert engine.cancels, "stop cancelled the engine's work"
    until_no_sessions(served_realtime)


def test_jambonz_stream_errors(served: Served) -> None:
    with ws_connect(served.ws + "/v1/jambonz/stream?sampleRate=11025") as ws:
        error = json_of(ws.recv(timeout=10))
        assert error["type"] == "error" and "sampleRate" in error["error"]
    with ws_connect(served.ws + "/v1/jambonz/stream?seed=abc") as ws:
        error = json_of(ws.recv(timeout=10))
        assert error["type"] == "error" and "seed" in error["error"]
    with httpx.Client(timeout=30.0) as http:
        response = http.post(served.http + "/v1/jambonz/tts?seed=abc", json={"text": "Hi.", "type": "text"},
                             headers={"authorization": "Bearer jambonz-key"})
    assert response.status_code == 400 and "seed" in response.text
    with ws_connect(served.ws + "/v1/jambonz/stream") as ws:
        assert json_of(ws.recv(timeout=10))["data"]["sample_rate"] == 8_000  # a call's rate by default
        send_json(ws, {"type": "speak", "text": "x"})
        assert json_of(ws.recv(timeout=10))["type"] == "error"
        send_json(ws, {"type": "stream"})
        assert json_of(ws.recv(timeout=10)) == {"type": "error", "error": "the message carries no text",
                                                "code": "empty_message"}


def until_no_sessions(served: Served, timeout_s: float = 10.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while served.live.hub.sessions:
        assert time.monotonic() < deadline_s, "a session outlived its connection"
        time.sleep(0.01)
