"""ElevenLabs text to speech over HTTP: request parsing, error bodies, response bodies. Pure.

Routes (`POST`, JSON body), as the `elevenlabs` SDK calls them:
- `/v1/text-to-speech/{voice_id}` (`text_to_speech.convert`): the audio, streamed as it is made;
- `/v1/text-to-speech/{voice_id}/stream` (`.stream`): the same;
- `/v1/text-to-speech/{voice_id}/with-timestamps` (`.convert_with_timestamps`): one JSON object,
  `{"audio_base64", "alignment", "normalized_alignment"}`;
- `/v1/text-to-speech/{voice_id}/stream/with-timestamps` (`.stream_with_timestamps`): newline-delimited
  JSON objects of that shape, one per piece of audio or alignment.

Query: `output_format` (`formats.elevenlabs_format`, default `mp3_44100_128`), `enable_logging` and
`optimize_streaming_latency` (accepted, ignored). Body: `text` (required), `model_id`, `language_code`,
`seed` (served); `voice_settings`, `pronunciation_dictionary_locators`, `previous_text`, `next_text`,
`previous_request_ids`, `next_request_ids`, `use_pvc_as_ivc`, `apply_text_normalization`,
`apply_language_text_normalization`, `audio_effects` (type-checked, ignored); anything else is refused.

Alignment times are seconds from the start of the request's audio (what Pipecat's HTTP service reads).
Errors: request validation is 422 `{"detail": [{"loc": ["body"|"query", field], "msg", "type"}]}` (the
SDK's `UnprocessableEntityError`); other failures `{"detail": {"status", "message"}}` with their status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agent_server.codecs import StreamFormat
from agent_server.compat.common import (
    CompatError,
    b64,
    check_model,
    load_object,
    parse_seed,
    resolve_language,
)
from agent_server.compat.formats import elevenlabs_format
from agent_server.timestamps import seconds

STATUS_UNPROCESSABLE = 422
QUERY_FIELDS = frozenset({"output_format", "enable_logging", "optimize_streaming_latency"})
BODY_FIELDS = frozenset(
    {
        "text",
        "model_id",
        "language_code",
        "seed",
        "voice_settings",
        "pronunciation_dictionary_locators",
        "previous_text",
        "next_text",
        "previous_request_ids",
        "next_request_ids",
        "use_pvc_as_ivc",
        "apply_text_normalization",
        "apply_language_text_normalization",
        "audio_effects",
    }
)
_OPTIONAL_TYPES: Mapping[str, tuple[type, ...]] = {
    "voice_settings": (dict,),
    "audio_effects": (dict,),
    "pronunciation_dictionary_locators": (list,),
    "previous_request_ids": (list,),
    "next_request_ids": (list,),
    "previous_text": (str,),
    "next_text": (str,),
    "model_id": (str,),
    "language_code": (str,),
    "use_pvc_as_ivc": (bool,),
    "apply_language_text_normalization": (bool,),
}
TEXT_NORMALIZATION = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    voice_id: str  # as given: the caller maps it onto our voices (common.resolve_voice)
    text: str
    model_id: str | None
    language: str | None  # resolved for the variant (None: the variant's own)
    seed: int | None
    output: StreamFormat
    streamed: bool  # /stream routes: the client reads as it comes (every route streams the audio)
    timestamps: bool  # /with-timestamps routes: JSON bodies with alignment


def parse_request(
    voice_id: str, query: Mapping[str, str], body: object, variant: str, *, streamed: bool, timestamps: bool
) -> SpeechRequest:
    """Raises CompatError; `error_body` renders it."""
    output = elevenlabs_format(query.get("output_format"))
    obj = load_object(body, BODY_FIELDS, what="body", unknown_message="extra field {name!r} is not permitted")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise CompatError("text", "text is required and must be a non-empty string")
    for name, kinds in _OPTIONAL_TYPES.items():
        value = obj.get(name)
        if value is not None and not isinstance(value, kinds):
            raise CompatError(name, f"{name} must be a {' or '.join(k.__name__ for k in kinds)}")
    normalization = obj.get("apply_text_normalization")
    if normalization is not None and normalization not in TEXT_NORMALIZATION:
        raise CompatError("apply_text_normalization", f"apply_text_normalization must be one of {', '.join(TEXT_NORMALIZATION)}")
    model_id = obj.get("model_id")
    check_model("model_id", model_id, variant)
    return SpeechRequest(
        voice_id=voice_id,
        text=text,
        model_id=model_id,
        language=resolve_language("language_code", obj.get("language_code"), variant),
        seed=parse_seed("seed", obj.get("seed")),
        output=output,
        streamed=streamed,
        timestamps=timestamps,
    )


def error_body(exc: CompatError) -> tuple[int, dict[str, Any]]:
    """A refused request: 422 with FastAPI's validation shape, as ElevenLabs answers."""
    where = "query" if exc.field in QUERY_FIELDS else "body"
    return STATUS_UNPROCESSABLE, {"detail": [{"loc": [where, exc.field], "msg": exc.message, "type": "value_error"}]}


def status_body(status: str, message: str) -> dict[str, Any]:
    """Any other failure (busy, rate limited, generation failed, not ready), with its HTTP status."""
    return {"detail": {"status": status, "message": message}}


def alignment(chars: Sequence[str], start_ms: Sequence[int], end_ms: Sequence[int]) -> dict[str, Any]:
    return {
        "characters": list(chars),
        "character_start_times_seconds": seconds(start_ms),
        "character_end_times_seconds": seconds(end_ms),
    }


def with_timestamps_body(audio: bytes, chars: Sequence[str], start_ms: Sequence[int],
                         end_ms: Sequence[int]) -> dict[str, Any]:
    """`/with-timestamps`: all the audio and the whole request's alignment (our text is not normalised,
    so `normalized_alignment` is the same)."""
    aligned = alignment(chars, start_ms, end_ms)
    return {"audio_base64": b64(audio), "alignment": aligned, "normalized_alignment": aligned}


def stream_line(audio: bytes, aligned: dict[str, Any] | None) -> bytes:
    """One line of `/stream/with-timestamps`: a piece of audio, with the alignment of the characters it
    completes (None when it completes none)."""
    body = {"audio_base64": b64(audio), "alignment": aligned, "normalized_alignment": aligned}
    return orjson.dumps(body) + b"\n"


def media_type(request: SpeechRequest) -> str:
    return "application/json" if request.timestamps else request.output.mime_type
