"""What every vendor-compatible endpoint shares: model, voice, language and seed mapping onto this
server (the model and language through the one route table, core/routing.py), stream specs, alignment in vendor
units. Pure: no sockets, no awaits. Every refusal is a
`FieldError` (agent_server/errors.py), rendered by each vendor module in its own shape."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import SegmentDone, StreamSpec, build_params, parse_speed
from agent_server.core.port import Port
from agent_server.core.routing import Routed, Router
from agent_server.errors import FieldError
from agent_server.text.timestamps import ContextAlignment, SegmentTimes

SEED_LIMIT = 2**63
DEFAULT_VOICE = "default"


def load_object(raw: str | bytes | object, allowed: frozenset[str] | set[str], *, what: str = "message",
                unknown_message: str = "unknown field {name!r}") -> dict[str, Any]:
    """A client's JSON object with only `allowed` keys, else FieldError naming the field at fault.
    `raw` may be already-decoded JSON (an HTTP body)."""
    if isinstance(raw, (str, bytes)):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise FieldError(what, f"the {what} must be a JSON object") from None
    if not isinstance(raw, dict):
        raise FieldError(what, f"the {what} must be a JSON object")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise FieldError(unknown[0], unknown_message.format(name=unknown[0]))
    return raw


def route(router: Router, *, model_field: str = "model", model: object = None, language_field: str = "language",
          language: object = None) -> Routed:
    """The loaded model for a request's model name and language fields (either absent: None), through the one
    table (core/routing.py). Raises FieldError naming the field at fault, in every protocol the same."""
    if model is not None and not isinstance(model, str):
        raise FieldError(model_field, f"{model_field} must be a string")
    if language is not None and not isinstance(language, str):
        raise FieldError(language_field, f"{language_field} must be a string")
    return router.route(model_field=model_field, model=model or None, language_field=language_field,
                             language=language or None)


def resolve_voice(port: Port, requested: str | None) -> str:
    """A voice id of ours selects that voice; any other id (a vendor's) selects the default voice."""
    if requested and any(v.voice_id == requested for v in port.voices.list()):
        return requested
    return DEFAULT_VOICE


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


# Cartesia's named speeds (its `speed` and `__experimental_controls.speed`) as multipliers
CARTESIA_SPEEDS: Mapping[str, float] = {"slowest": 0.7, "slow": 0.85, "normal": 1.0, "fast": 1.15, "fastest": 1.3}


def voice_settings_speed(settings: object) -> float:
    """ElevenLabs' `voice_settings.speed` (the other voice settings do not apply to Chatterbox)."""
    return parse_speed("voice_settings.speed", settings.get("speed")) if isinstance(settings, dict) else 1.0


ELEVENLABS_NORMALIZATION = ("auto", "on", "off")


def elevenlabs_normalization(value: object) -> bool:
    """ElevenLabs' `apply_text_normalization` (absent: "auto"): whether numbers, money, dates ... are said as
    words (agent_server/text/normalize/). "auto" is on: what ElevenLabs' own "auto" does for the text a voice
    agent sends (it leaves normalisation to the model only for its larger models)."""
    if value is None or value == "":
        return True
    if value not in ELEVENLABS_NORMALIZATION:
        raise FieldError("apply_text_normalization",
                         f"apply_text_normalization must be one of {', '.join(ELEVENLABS_NORMALIZATION)}")
    return value != "off"


def cartesia_speed(request: Mapping[str, Any]) -> float:
    """A Cartesia request's speed: `generation_config.speed` (a multiplier, Sonic 3), else `speed` (a name or a
    multiplier), else the older `voice.__experimental_controls.speed` (a name, or -1..1 from slowest to fastest)."""
    config = request.get("generation_config")
    if config is not None and not isinstance(config, dict):
        raise FieldError("generation_config", "generation_config must be an object")
    if config and config.get("speed") is not None:
        return parse_speed("generation_config.speed", config["speed"])
    if request.get("speed") is not None:
        return _named_speed("speed", request["speed"]) or parse_speed("speed", request["speed"])
    voice = request.get("voice")
    controls = voice.get("__experimental_controls") if isinstance(voice, dict) else None
    legacy = controls.get("speed") if isinstance(controls, dict) else None
    if legacy is None:
        return 1.0
    field = "voice.__experimental_controls.speed"
    named = _named_speed(field, legacy)
    if named is not None:
        return named
    if isinstance(legacy, bool) or not isinstance(legacy, (int, float)) or not -1.0 <= legacy <= 1.0:
        raise FieldError(field, f"{field} must be a name or a number in [-1, 1] (got {legacy!r})")
    low, high = CARTESIA_SPEEDS["slowest"], CARTESIA_SPEEDS["fastest"]
    return 1.0 + float(legacy) * ((high - low) / 2.0)


def _named_speed(field: str, value: object) -> float | None:
    if not isinstance(value, str) or value.replace(".", "", 1).lstrip("-").isdigit():
        return None
    if value not in CARTESIA_SPEEDS:
        raise FieldError(field, f"{field} must be one of {', '.join(CARTESIA_SPEEDS)} or a number (got {value!r})")
    return CARTESIA_SPEEDS[value]


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
    port: Port, *, voice_id: str, output_format: StreamFormat, seed: int | None, routed: Routed,
    max_audio_ahead_s: float | None = None, speed: float = 1.0, markup: frozenset[str] = frozenset(),
    normalize: bool = True,
) -> StreamSpec:
    """A stream spec spoken by the routed model (its sampling defaults, its language)."""
    params = build_params(routed.model, (), seed)
    settings = port.settings
    return StreamSpec(
        voice_id=voice_id,
        params=params,
        output_format=output_format,
        language=routed.language,
        model=routed.model,
        may_wait=settings.queue_when_full,
        # None: the server's; a client that takes the whole answer at once (a unary call) passes math.inf
        max_audio_ahead_s=settings.max_audio_ahead_s if max_audio_ahead_s is None else max_audio_ahead_s,
        speed=speed,
        markup=markup,
        normalize=normalize,
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


BREAK_PUNCTUATION = frozenset(".!?;:,")


@dataclass(slots=True)
class PieceJoiner:
    """Joins the text pieces of one context the way they were meant to be read. Some clients send each
    sentence as a piece with its spaces stripped (Pipecat: "with that." then "Your flight"); glued, the
    segmenter would see "that.Your", one run-on word. A piece that starts with a letter or digit right after
    a piece that ended on punctuation gets a space, unless both sides are digits and the piece before was a
    token (no space inside: an LLM's "3" "." "5" is 3.5, its "1," "000" is 1,000). A sentence ending in a
    number ("Your order is 12.") then one starting with one ("3 items shipped.") are two sentences: Pipecat
    cuts a sentence only after seeing what follows its period, so "12.3" never reaches it split."""

    tail: str = ""  # the last two characters of the text so far
    last_was_token: bool = True  # the last non-empty piece had no whitespace inside

    def join(self, piece: str) -> str:
        if not piece:
            return piece
        tail = self.tail
        number_goes_on = len(tail) == 2 and tail[0].isdigit() and piece[0].isdigit() and self.last_was_token
        if tail and tail[-1] in BREAK_PUNCTUATION and piece[0].isalnum() and not number_goes_on:
            piece = " " + piece
        self.tail = (tail + piece)[-2:]
        self.last_was_token = not any(c.isspace() for c in piece.strip())
        return piece


def place_segment(alignment: ContextAlignment, done: SegmentDone) -> SegmentTimes:
    """Put a finished segment's alignment (its times are from the start of the context's audio) on the
    context's timeline, where the client's decoder plays it (`ContextAlignment.lead_ms`)."""
    return alignment.add(done.text, done.char_start_ms, done.char_duration_ms, done.audio_offset_ms, done.audio_ms,
                         segment_relative=False)
