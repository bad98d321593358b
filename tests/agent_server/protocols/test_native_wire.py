"""agent_server.protocol: pure parse / encode, no sockets."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_server.core.events import build_params
from agent_server.core.stream import char_alignment
from agent_server.errors import FieldError
from agent_server.protocols import native_wire as wire
from synth.api import SamplingParams

pytestmark = pytest.mark.timeout(60)


def parse_obj(obj: object) -> wire.Message | FieldError:
    return wire.parse(json.dumps(obj))


def error_field(obj: object) -> str:
    result = parse_obj(obj)
    assert isinstance(result, FieldError), result
    return result.field


# ---- client messages ----------------------------------------------------------------------------


def test_open_with_every_field() -> None:
    msg = parse_obj(
        {
            "type": "open",
            "context_id": "turn-1",
            "voice": "v_abc",
            "model": "english",
            "output_format": {"encoding": "mulaw", "sample_rate_hz": 8000, "frame_ms": 20},
            "sampling": {"temperature": 0.7, "top_k": 50, "max_new_tokens": 300},
            "seed": 42,
            "language": "EN",
            "text": "Hello",
        }
    )
    assert isinstance(msg, wire.Open)
    assert msg.context_id == "turn-1" and msg.voice == "v_abc" and msg.model == "english"
    assert msg.output_format.encoding == "mulaw"
    assert msg.output_format.sample_rate_hz == 8000
    assert msg.output_format.frame_ms == 20
    assert dict(msg.sampling) == {"temperature": 0.7, "top_k": 50, "max_new_tokens": 300}
    assert isinstance(dict(msg.sampling)["temperature"], float)
    assert msg.seed == 42 and msg.language == "en" and msg.text == "Hello"


def test_open_defaults() -> None:
    msg = parse_obj({"type": "open", "context_id": "c"})
    assert isinstance(msg, wire.Open)
    assert msg.voice == "default" and msg.model is None and msg.seed is None and msg.sampling == ()
    fmt = msg.output_format
    assert (fmt.encoding, fmt.sample_rate_hz, fmt.frame_ms) == ("pcm_s16le", 24000, 20)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"type": "text", "context_id": "c", "text": "Hi"}, wire.Text("c", "Hi")),
        ({"type": "flush", "context_id": "c"}, wire.Flush("c")),
        ({"type": "end", "context_id": "c"}, wire.End("c")),
        ({"type": "cancel", "context_id": "c"}, wire.Cancel("c")),
    ],
)
def test_simple_messages(obj: dict[str, object], expected: wire.Message) -> None:
    assert parse_obj(obj) == expected


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"context_id": "c"}, "type"),
        ({"type": 3, "context_id": "c"}, "type"),
        ({"type": "speak", "context_id": "c"}, "type"),
        ({"type": "text", "context_id": "c", "text": "x", "extra": 1}, "extra"),
        ({"type": "text", "text": "x"}, "context_id"),
        ({"type": "text", "context_id": 7, "text": "x"}, "context_id"),
        ({"type": "text", "context_id": "", "text": "x"}, "context_id"),
        ({"type": "text", "context_id": "a b", "text": "x"}, "context_id"),
        ({"type": "text", "context_id": "c" * 65, "text": "x"}, "context_id"),
        ({"type": "text", "context_id": "c", "text": 12}, "text"),
        ({"type": "open", "context_id": "c", "voice": 3}, "voice"),
        ({"type": "open", "context_id": "c", "voice": ""}, "voice"),
        ({"type": "open", "context_id": "c", "model": 7}, "model"),  # (any name is routed: core/routing.py)
        ({"type": "open", "context_id": "c", "model": "m" * 65}, "model"),
        ({"type": "open", "context_id": "c", "seed": -1}, "seed"),
        ({"type": "open", "context_id": "c", "seed": 1.5}, "seed"),
        ({"type": "open", "context_id": "c", "seed": True}, "seed"),
        ({"type": "open", "context_id": "c", "seed": 2**63}, "seed"),
        ({"type": "open", "context_id": "c", "language": "french"}, "language"),
        ({"type": "open", "context_id": "c", "language": 1}, "language"),
        ({"type": "open", "context_id": "c", "text": ["a"]}, "text"),
        ({"type": "open", "context_id": "c", "sampling": [1]}, "sampling"),
        ({"type": "open", "context_id": "c", "sampling": {"temp": 1}}, "sampling.temp"),
        ({"type": "open", "context_id": "c", "sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"type": "open", "context_id": "c", "sampling": {"temperature": True}}, "sampling.temperature"),
        ({"type": "open", "context_id": "c", "sampling": {"top_k": 1.5}}, "sampling.top_k"),
        ({"type": "open", "context_id": "c", "output_format": "pcm"}, "output_format"),
        ({"type": "open", "context_id": "c", "output_format": {"rate": 8000}}, "output_format.rate"),
        ({"type": "open", "context_id": "c", "output_format": {"encoding": 1}}, "output_format.encoding"),
        ({"type": "open", "context_id": "c", "output_format": {"encoding": "mp3"}}, "output_format.encoding"),
        (
            {"type": "open", "context_id": "c", "output_format": {"sample_rate_hz": "8k"}},
            "output_format.sample_rate_hz",
        ),
        (
            {"type": "open", "context_id": "c", "output_format": {"sample_rate_hz": 12345}},
            "output_format.sample_rate_hz",
        ),
        (
            {"type": "open", "context_id": "c", "output_format": {"encoding": "mulaw", "sample_rate_hz": 16000}},
            "output_format.sample_rate_hz",
        ),
        ({"type": "open", "context_id": "c", "output_format": {"frame_ms": "20"}}, "output_format.frame_ms"),
        ({"type": "open", "context_id": "c", "output_format": {"frame_ms": 0}}, "output_format.frame_ms"),
        ({"type": "open", "context_id": "c", "output_format": {"frame_ms": 100000}}, "output_format.frame_ms"),
    ],
)
def test_errors_name_the_field(obj: dict[str, object], field: str) -> None:
    assert error_field(obj) == field


def test_a_text_without_text_is_the_cores_to_answer() -> None:
    """The session core answers it (`empty_message`, as for every protocol), so the parser passes it on."""
    for obj in ({"type": "text", "context_id": "c"}, {"type": "text", "context_id": "c", "text": None}):
        assert parse_obj(obj) == wire.Text("c", None)


def test_error_keeps_the_context_id() -> None:
    result = parse_obj({"type": "text", "context_id": "c9", "text": 1})
    assert isinstance(result, FieldError) and result.context_id == "c9"


@pytest.mark.parametrize(
    ("raw", "field"),
    [("{not json", "message"), ("[1, 2]", "message"), ('"text"', "message"), ("", "message")],
)
def test_malformed(raw: str, field: str) -> None:
    result = wire.parse(raw)
    assert isinstance(result, FieldError) and result.field == field


def test_binary_is_refused() -> None:
    result = wire.parse(b'{"type": "flush", "context_id": "c"}')
    assert isinstance(result, FieldError) and result.field == "message"


def test_text_length_is_not_the_parsers_business() -> None:
    """One set of text limits for every protocol lives in the session core (tests/agent_server/
    test_session_core.py); the parser takes any length."""
    ok = parse_obj({"type": "text", "context_id": "c", "text": "a" * 100_000})
    assert isinstance(ok, wire.Text) and ok.text is not None and len(ok.text) == 100_000


def test_sampling_fields_are_sampling_params() -> None:
    assert set(wire.SAMPLING_FIELDS) <= set(SamplingParams.__dataclass_fields__)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["open", "text", "flush", "end", "cancel", "nope"]),
    extra=st.dictionaries(
        st.sampled_from(["context_id", "text", "voice", "model", "output_format", "sampling", "seed", "language"]),
        json_values,
        max_size=5,
    ),
)
def test_parse_never_raises(kind: str, extra: dict[str, object]) -> None:
    result = parse_obj({"type": kind, **extra})
    assert isinstance(result, (wire.Open, wire.Text, wire.Flush, wire.End, wire.Cancel, FieldError))


@settings(max_examples=200, deadline=None)
@given(raw=st.text(max_size=200) | st.binary(max_size=50))
def test_parse_never_raises_on_garbage(raw: str | bytes) -> None:
    assert wire.parse(raw) is not None


# ---- server events ------------------------------------------------------------------------------


def test_encode_events() -> None:
    started = orjson.loads(
        wire.encode(
            wire.ContextStarted(
                context_id="c",
                stream_id=3,
                voice="default",
                variant="english",
                output_format={"encoding": "pcm_s16le", "sample_rate_hz": 24000, "frame_ms": 20},
                seed=None,
            )
        )
    )
    assert started["type"] == "context_started" and started["stream_id"] == 3 and started["seed"] is None
    done = orjson.loads(
        wire.encode(
            wire.ContextDone(
                context_id="c",
                reason="completed",
                detail="",
                segments=2,
                frames=10,
                audio_ms=200.0,
                timing=wire.Timing(1.0, 1.1, 1.2, 1.25, 250.0, 50.0),
            )
        )
    )
    assert done["type"] == "context_done" and done["timing"]["server_overhead_ms"] == 50.0
    err = orjson.loads(wire.encode(wire.error_event(FieldError("seed", "bad", context_id="c"))))
    assert err == {"type": "error", "context_id": "c", "field": "seed", "message": "bad", "code": "bad_request"}
    seg = orjson.loads(
        wire.encode(
            wire.SegmentDone(
                context_id="c",
                segment_index=0,
                audio_offset_ms=0.0,
                audio_ms=80.0,
                speech_tokens=2,
                alignment=wire.Alignment(["h", "i"], [0, 40], [40, 40]),
            )
        )
    )
    assert seg["alignment"] == {"chars": ["h", "i"], "char_start_ms": [0, 40], "char_duration_ms": [40, 40]}


def test_frame_header_round_trip() -> None:
    header = wire.FrameHeader(stream_id=7, seq=123456, segment_index=70000, encoding_code=2)
    data = wire.encode_frame(header, b"\x01\x02\x03")
    assert len(data) == wire.FRAME_HEADER_BYTES + 3
    decoded, payload = wire.decode_frame(data)
    assert payload == b"\x01\x02\x03"
    assert (decoded.stream_id, decoded.seq, decoded.encoding_code) == (7, 123456, 2)
    assert decoded.segment_index == 70000 % 65536
    with pytest.raises(ValueError):
        wire.decode_frame(b"\x01\x02")
    with pytest.raises(ValueError):
        wire.decode_frame(b"\x09" + data[1:])


# ---- helpers shared with the session --------------------------------------------------------------


def test_build_params() -> None:
    params = build_params("turbo", (("temperature", 0.5),), seed=7)
    assert params.temperature == 0.5 and params.seed == 7 and params.top_p == 0.95  # turbo's default
    with pytest.raises(FieldError) as err:
        build_params("english", (("temperature", 0.0),), seed=None)
    assert err.value.field == "sampling.temperature"
    with pytest.raises(FieldError) as err:
        build_params("english", (("max_new_tokens", 5000),), seed=None)
    assert err.value.field == "sampling.max_new_tokens"


def test_char_alignment_covers_the_segment() -> None:
    starts, durations = char_alignment("Hi, you.", 1000.0, 800.0)
    assert len(starts) == len(durations) == 8
    assert starts[0] == 1000
    assert starts[-1] + durations[-1] == 1800
    assert all(b == a + d for a, b, d in zip(starts, starts[1:], durations, strict=False))
    assert durations[2] > durations[3]  # a comma takes longer than a space
    assert char_alignment("", 0.0, 100.0) == ([], [])


def test_keepalive_needs_no_context_and_takes_no_fields() -> None:
    assert wire.parse('{"type": "keepalive"}') == wire.KeepAlive()
    err = wire.parse('{"type": "keepalive", "context_id": "x"}')
    assert isinstance(err, FieldError) and err.field == "context_id"
