"""Deepgram text to speech over HTTP: `POST /v1/speak` (`speak.v1.audio.generate`). Pure.

Body `{"text"}` (at most 2000 characters, Deepgram's limit). Query: `model` (also the voice, as on the
WebSocket), `encoding` / `container` / `sample_rate` / `bit_rate` (`formats.deepgram_format`; default
linear16 in a WAV container at 24 kHz), `seed` (our extension), `mip_opt_out`, `tag`, `speed` (accepted,
ignored). `callback` / `callback_method` are refused: this server answers in the response, it does not
call out. The response streams the audio; headers `content-type`, `dg-request-id`, `dg-model-name`,
`dg-char-count`. Errors: `{"err_code", "err_msg", "request_id"}` (400 for a bad request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent_server.codecs import StreamFormat
from agent_server.compat.common import CompatError, check_model, load_object, parse_seed
from agent_server.compat.deepgram import DEFAULT_MODEL, MAX_SPEAK_CHARS
from agent_server.compat.formats import deepgram_format

STATUS_BAD_REQUEST = 400
QUERY_FIELDS = frozenset(
    {"model", "encoding", "container", "sample_rate", "bit_rate", "seed", "mip_opt_out", "tag", "speed",
     "callback", "callback_method"}
)
REFUSED_QUERY = ("callback", "callback_method")
BODY_FIELDS = frozenset({"text"})


@dataclass(frozen=True, slots=True)
class SpeakRequest:
    text: str
    model: str  # the voice too (common.resolve_voice)
    seed: int | None
    output: StreamFormat


def parse_request(query: Mapping[str, str], body: object, variant: str) -> SpeakRequest:
    """Raises CompatError; `error_body` renders it."""
    for name in REFUSED_QUERY:
        if query.get(name):
            raise CompatError(name, f"{name} is not served: the audio comes back in the response")
    model = query.get("model") or DEFAULT_MODEL
    check_model("model", model, variant)
    output = deepgram_format(query, rest=True)
    obj = load_object(body, BODY_FIELDS, what="body")
    text = obj.get("text")
    if not isinstance(text, str) or not text.strip():
        raise CompatError("text", "text is required and must be a non-empty string")
    if len(text) > MAX_SPEAK_CHARS:
        raise CompatError("text", f"text is longer than {MAX_SPEAK_CHARS} characters")
    return SpeakRequest(text=text, model=model, seed=parse_seed("seed", query.get("seed")), output=output)


def error_body(exc: CompatError, request_id: str) -> tuple[int, dict[str, Any]]:
    code = "INVALID_QUERY_PARAMETER" if exc.field in QUERY_FIELDS else "INVALID_REQUEST_BODY"
    return STATUS_BAD_REQUEST, status_body(code, f"{exc.field}: {exc.message}", request_id)


def status_body(err_code: str, err_msg: str, request_id: str) -> dict[str, Any]:
    """Any other failure (busy 429, generation failed 500, not ready 503)."""
    return {"err_code": err_code, "err_msg": err_msg, "request_id": request_id}


def response_headers(request: SpeakRequest, request_id: str) -> dict[str, str]:
    return {
        "content-type": request.output.mime_type,
        "dg-request-id": request_id,
        "dg-model-name": request.model,
        "dg-char-count": str(len(request.text)),
    }
