"""What every vendor-compatible endpoint shares: model, voice, language and seed mapping onto this
server, stream specs, alignment in vendor units. Pure: no sockets, no awaits. Every refusal is a
`FieldError` (agent_server/errors.py), rendered by each vendor module in its own shape."""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from agent_server.audio import OutputFormat
from agent_server.errors import FieldError
from agent_server.hub import Hub
from agent_server.speech import SegmentDone, StreamSpec, build_params

SEED_LIMIT = 2**63
DEFAULT_VOICE = "default"
# Our own model names (any spelling below) must match the variant the server runs; every other model
# name is a vendor's (eleven_flash_v2_5, sonic-2, aura-2-thalia-en, tts-1, ...) and is served by it.
OUR_MODELS: Mapping[str, str] = {
    "english": "english",
    "chatterbox": "english",
    "chatterbox-english": "english",
    "turbo": "turbo",
    "chatterbox-turbo": "turbo",
    "multilingual": "multilingual",
    "chatterbox-multilingual": "multilingual",
}
_LANGUAGE = re.compile(r"^([A-Za-z]{2,3})(?:[-_][A-Za-z0-9]+)*$")
_WORD = re.compile(r"\S+")


def load_object(raw: str | bytes | object, allowed: frozenset[str] | set[str], *, what: str = "message",
                unknown_message: str = "unknown field {name!r}") -> dict[str, Any]:
    """A client's JSON object with only `allowed` keys, else FieldError naming the field at fault.
    `raw` may be already-decoded JSON (an HTTP body)."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise FieldError(what, f"{what}s must be JSON objects") from None
    if not isinstance(raw, dict):
        raise FieldError(what, f"{what}s must be JSON objects")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise FieldError(unknown[0], unknown_message.format(name=unknown[0]))
    return raw


def check_model(field: str, requested: str | None, variant: str) -> None:
    if not requested:
        return
    ours = OUR_MODELS.get(requested.lower())
    if ours is not None and ours != variant:
        raise FieldError(field, f"this server runs the {variant!r} variant (one variant per server), not {requested!r}")


def resolve_voice(hub: Hub, requested: str | None) -> str:
    """A voice id of ours selects that voice; any other id (a vendor's) selects the default voice."""
    if requested and any(v.voice_id == requested for v in hub.voices.list()):
        return requested
    return DEFAULT_VOICE


def resolve_language(field: str, requested: str | None, variant: str) -> str | None:
    """"en", "en-US", "fr_FR" -> the 2-3 letter code; None when not given. English-only variants take "en"."""
    if not requested:
        return None
    match = _LANGUAGE.match(requested)
    if match is None:
        raise FieldError(field, f"not a language code: {requested!r}")
    code = match.group(1).lower()
    if variant != "multilingual":
        if code != "en":
            raise FieldError(field, f"the {variant!r} variant speaks English only (got {requested!r})")
        return None
    return code


def parse_seed(field: str, value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise FieldError(field, "seed must be an integer")
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise FieldError(field, f"seed must be an integer (got {value!r})") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise FieldError(field, f"seed must be an integer in [0, 2**63) (got {value!r})")
    return value


def is_decimal(raw: str) -> bool:
    """ASCII digits only (`str.isdigit` also takes "¹" and "٣", which `int` then refuses or reads)."""
    return raw.isascii() and raw.isdigit()


def parse_decimal(raw: str | None) -> int | None:
    """A query parameter's non-negative integer; None when absent or empty; -1 when not a number
    (callers range-check it, so -1 is refused with their own message)."""
    if raw is None or raw == "":
        return None
    return int(raw) if is_decimal(raw) else -1


def make_spec(
    hub: Hub, *, voice_id: str, output_format: OutputFormat, seed: int | None, language: str | None
) -> StreamSpec:
    params = build_params(hub.engine.variant if hub.engine is not None else hub.settings.variant, (), seed)
    settings = hub.settings
    return StreamSpec(
        voice_id=voice_id,
        params=params,
        output_format=output_format,
        language=language,
        may_wait=settings.queue_when_full,
        max_audio_ahead_s=settings.max_audio_ahead_s,
    )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def query_flag(params: Mapping[str, str], name: str, default: bool = False) -> bool:
    raw = params.get(name)
    if raw is None or raw == "":
        return default
    value = raw.lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise FieldError(name, f"{name} must be true or false (got {raw!r})")


@dataclass(frozen=True, slots=True)
class CharTimes:
    """Per-character timing of one segment, relative to the segment's start (ms)."""

    chars: list[str]
    start_ms: list[int]
    duration_ms: list[int]


def segment_char_times(done: SegmentDone, trailing_space: bool) -> CharTimes:
    """The segment's approximate alignment, made relative to its own start. With `trailing_space`, a
    zero-length space ends it, so a client gluing segments together sees a word boundary."""
    offset_ms = round(done.audio_offset_ms)
    chars = list(done.text)
    starts = [s - offset_ms for s in done.char_start_ms]
    durations = list(done.char_duration_ms)
    if trailing_space and chars and not chars[-1].isspace():
        end_ms = starts[-1] + durations[-1]
        chars.append(" ")
        starts.append(end_ms)
        durations.append(0)
    return CharTimes(chars, starts, durations)


def segment_words(done: SegmentDone) -> tuple[list[str], list[float], list[float]]:
    """Words of a segment with absolute start and end times (seconds from the stream's start)."""
    words: list[str] = []
    starts_s: list[float] = []
    ends_s: list[float] = []
    for match in _WORD.finditer(done.text):
        first, last = match.start(), match.end() - 1
        words.append(match.group())
        starts_s.append(done.char_start_ms[first] / 1000.0)
        ends_s.append((done.char_start_ms[last] + done.char_duration_ms[last]) / 1000.0)
    return words, starts_s, ends_s
