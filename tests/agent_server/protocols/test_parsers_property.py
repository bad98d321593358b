"""Property tests of every protocol's message parser (native, ElevenLabs, Cartesia, Deepgram, OpenAI):
any input either parses or yields that protocol's own error; nothing else is raised. The targets are
`scripts/fuzz_protocols.py`'s (the atheris fuzzer drives the same functions)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_server.core.routing import DEFAULT_ROUTES, Router
from agent_server.errors import FieldError
from agent_server.protocols import cartesia, deepgram, elevenlabs, openai_speech
from agent_server.protocols import native_wire as wire

pytestmark = pytest.mark.timeout(120)

_SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "fuzz_protocols.py"


def _load_fuzz_script() -> Any:
    existing = sys.modules.get("fuzz_protocols")
    if existing is not None:
        return existing
    spec = importlib.util.spec_from_file_location("fuzz_protocols", _SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_protocols"] = module
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz_script()

# every field name any protocol knows, so that generated objects reach past the unknown-field checks
FIELD_NAMES = sorted(
    set().union(*wire.MESSAGE_FIELDS.values())
    | wire.FORMAT_FIELDS
    | set(wire.SAMPLING_FIELDS)
    | elevenlabs.MESSAGE_FIELDS
    | cartesia.REQUEST_FIELDS
    | openai_speech.BODY_FIELDS
    | {"container", "sample_rate", "mode", "id", "chunk_length_schedule"}
)
STRING_VALUES = [
    "open", "text", "flush", "end", "cancel", "Speak", "Flush", "Clear", "Close", "pcm_s16le", "mulaw", "alaw",
    "pcm_f32le", "pcm_mulaw", "raw", "wav", "pcm", "mp3", "sse", "audio", "english", "turbo", "multilingual",
    "tts-1", "default", "en", "en-US", "fr", "c1", "", " ", "x" * 65,
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(STRING_VALUES)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), children, max_size=5),
    max_leaves=12,
)
message_objects = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=10), json_values, max_size=8)


def _dumps(value: object) -> bytes:
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):  # ints beyond 64 bits: the json module writes them
        return json.dumps(value).encode()


# Characters for which str.isdigit() is True but int() refuses them, or reads them as another digit:
# the query parser that trusted isdigit() raised on them (`?inactivity_timeout=¹` leaked a session).
UNICODE_DIGITS = ["¹", "²", "³", "①", "٣", "۴", "𝟙", "৫", "²⁴⁰⁰⁰"]

query_strings = st.dictionaries(
    st.sampled_from(["model_id", "model", "output_format", "language_code", "inactivity_timeout", "seed",
                     "sync_alignment", "auto_mode", "encoding", "sample_rate", "container"]) | st.text(max_size=8),
    st.sampled_from(["pcm_16000", "ulaw_8000", "pcm_1", "linear16", "mulaw", "none", "wav", "24000", "8000",
                     "20", "181", "0", "-1", "true", "maybe", "en", "xx-YY", "english", "turbo"])
    | st.sampled_from(UNICODE_DIGITS).map(lambda d: d * 2 if len(d) == 1 else d)
    | st.builds(lambda prefix, digits: prefix + digits, st.sampled_from(["", "pcm_", "ulaw_"]),
                st.sampled_from(UNICODE_DIGITS))
    | st.text(max_size=12),
    max_size=6,
).map(lambda d: "&".join(f"{k}={v}" for k, v in d.items()).encode("utf-8", errors="replace"))

# What the fuzz script's bulk run draws from, too.
any_input = st.one_of(
    message_objects.map(_dumps),
    json_values.map(_dumps),
    query_strings,
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", errors="surrogatepass")),
)

# One valid message per shape; `mutated(target)` changes one field (nested ones too) to any JSON value,
# deletes it, or adds an unknown one: the type confusions a hand-written client makes.
VALID_MESSAGES: dict[str, list[dict[str, Any]]] = {
    "native": [
        {"type": "open", "context_id": "c1", "voice": "default", "model": "english",
         "output_format": {"encoding": "pcm_s16le", "sample_rate_hz": 24000, "frame_ms": 20},
         "sampling": {"temperature": 0.8, "top_k": 50, "max_new_tokens": 300}, "seed": 1, "language": "en",
         "text": "Hi."},
        {"type": "text", "context_id": "c1", "text": "more"},
        {"type": "end", "context_id": "c1"},
    ],
    "elevenlabs_message": [
        {"text": " ", "voice_settings": {"stability": 0.5}, "generation_config": {"chunk_length_schedule": [50]},
         "xi_api_key": "k", "flush": True, "context_id": "c1", "close_context": False, "close_socket": False,
         "try_trigger_generation": False},
    ],
    "cartesia_request": [
        {"context_id": "c1", "model_id": "sonic-2", "transcript": "Hi.", "voice": {"mode": "id", "id": "v"},
         "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000}, "continue": True,
         "flush": False, "add_timestamps": True, "language": "en", "seed": 3},
        {"context_id": "c1", "cancel": True},
    ],
    "deepgram_message": [{"type": "Speak", "text": "Hi."}, {"type": "Flush"}, {"type": "Clear"}],
    "openai_body": [
        {"model": "tts-1", "input": "Hi.", "voice": "alloy", "response_format": "pcm", "speed": 1.0,
         "instructions": "calm", "stream_format": "sse", "seed": 1},
    ],
}


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            paths.append((*prefix, key))
            paths += _paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            paths.append((*prefix, i))
            paths += _paths(value, (*prefix, i))
    return paths


replacements = st.one_of(
    scalars, st.lists(scalars, max_size=2), st.dictionaries(st.text(max_size=4), scalars, max_size=2)
)


@st.composite
def mutated(draw: st.DrawFn, target: str) -> bytes:
    samples = VALID_MESSAGES.get(target)
    if not samples:
        return draw(query_strings)
    obj = json.loads(json.dumps(draw(st.sampled_from(samples))))
    for _ in range(draw(st.integers(1, 2))):
        paths = _paths(obj)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = obj
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(replacements)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=8))] = draw(json_values)
    return _dumps(obj)


def input_for(target: str) -> st.SearchStrategy[bytes]:
    return st.one_of(mutated(target), any_input)


# (target, input) pairs over every target: the fuzz script's bulk run draws from this
targeted_inputs = st.sampled_from(list(fuzz.TARGETS)).flatmap(lambda t: st.tuples(st.just(t), input_for(t)))

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("target", list(fuzz.TARGETS))
@FAST
@given(data=st.data(), variant=st.sampled_from(fuzz.VARIANTS))
def test_every_input_parses_or_is_the_protocols_error(target: str, data: st.DataObject, variant: str) -> None:
    raw = data.draw(input_for(target))
    assert fuzz.check(target, raw, variant) in (fuzz.PARSED, fuzz.ERROR)


TYPE_CONFUSIONS: list[Any] = [
    None, True, False, 0, -1, 2**70, 1.5, -1e308, "", "x", "\u0000", [], [1], ["a"], {}, {"a": 1}
]


@pytest.mark.parametrize("target", list(VALID_MESSAGES))
def test_each_field_of_each_message_with_each_json_type(target: str) -> None:
    """Systematic: every field (nested ones too) of every valid message, replaced by a value of every JSON
    type, or deleted."""
    tried = 0
    for sample in VALID_MESSAGES[target]:
        for path in _paths(sample):
            for value in [*TYPE_CONFUSIONS, KeyError]:  # KeyError: delete the field
                obj = json.loads(json.dumps(sample))
                parent = obj
                for step in path[:-1]:
                    parent = parent[step]
                if value is KeyError:
                    del parent[path[-1]]
                else:
                    parent[path[-1]] = value
                for variant in fuzz.VARIANTS:
                    assert fuzz.check(target, _dumps(obj), variant) in (fuzz.PARSED, fuzz.ERROR), (path, value)
                    tried += 1
    assert tried > 100


@FAST
@given(data=st.binary(max_size=64))
def test_one_input_never_raises(data: bytes) -> None:
    fuzz.one_input(data)


# ---- valid messages parse to what they say ---------------------------------------------------------

context_ids = st.text(alphabet="abcXYZ019_.:-", min_size=1, max_size=64)
texts = st.text(max_size=300)


@FAST
@given(cid=context_ids, text=texts, kind=st.sampled_from(["text", "flush", "end", "cancel"]))
def test_native_valid_messages(cid: str, text: str, kind: str) -> None:
    obj: dict[str, Any] = {"type": kind, "context_id": cid}
    if kind == "text":
        obj["text"] = text
    message = wire.parse(orjson.dumps(obj).decode())
    assert not isinstance(message, (FieldError, wire.KeepAlive, wire.TwilioMessage)), message
    assert message.context_id == cid
    if kind == "text":
        assert isinstance(message, wire.Text) and message.text == text


@FAST
@given(obj=message_objects)
def test_native_errors_name_a_field_and_keep_the_context(obj: dict[str, Any]) -> None:
    result = wire.parse(_dumps(obj).decode())
    if isinstance(result, FieldError):
        assert (result.field or "" in obj) and isinstance(result.message, str)  # an unknown field may be named ""
        assert result.context_id is None or result.context_id == obj.get("context_id")
        event = orjson.loads(wire.encode(wire.error_event(result)))
        assert event["type"] == "error" and event["field"] == result.field


@FAST
@given(cid=st.text(min_size=1, max_size=256), text=texts, cont=st.booleans(), flush=st.booleans())
def test_cartesia_valid_requests(cid: str, text: str, cont: bool, flush: bool) -> None:
    request = cartesia.parse_request(orjson.dumps({
        "context_id": cid, "transcript": text, "continue": cont, "flush": flush,
        "voice": {"mode": "id", "id": "v"},
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000},
    }).decode())
    assert (request.context_id, request.transcript, request.continue_, request.flush) == (cid, text, cont, flush)
    assert request.output.sample_rate_hz == 16000


@FAST
@given(text=texts, flush=st.booleans(), cid=st.none() | st.text(min_size=1, max_size=256))
def test_elevenlabs_valid_messages(text: str, flush: bool, cid: str | None) -> None:
    obj: dict[str, Any] = {"text": text, "flush": flush}
    if cid is not None:
        obj["context_id"] = cid
    message = elevenlabs.parse_message(orjson.dumps(obj).decode())
    assert (message.text, message.flush, message.context_id) == (text, flush, cid)


@FAST
@given(text=texts)
def test_deepgram_valid_messages(text: str) -> None:
    assert deepgram.parse_message(orjson.dumps({"type": "Speak", "text": text}).decode()) == ("Speak", text)


@FAST
@given(text=st.text(min_size=1, max_size=4096).filter(str.strip), seed=st.none() | st.integers(0, 2**63 - 1))
def test_openai_valid_bodies(text: str, seed: int | None) -> None:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm", "seed": seed}
    request = openai_speech.parse_request(body, Router(DEFAULT_ROUTES, ("english",)))
    assert (request.input, request.seed) == (text, seed)
