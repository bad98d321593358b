"""Deepgram text to speech over HTTP: `POST /v1/speak` (`speak.v1.audio.generate`), on the HTTP speech base
(protocols/http_speech.py). The same path serves Deepgram's WebSocket (protocols/deepgram.py): Starlette routes
a WebSocket handshake and a POST to each by the request's type.

Body `{"text"}` (held to the server's text limit, `max_text_piece_chars`). Query: `model` (also the voice, as on the
WebSocket), `encoding` / `container` / `sample_rate` / `bit_rate` (`formats.deepgram_format`; default
linear16 in a WAV container at 24 kHz), `seed` (our extension), `mip_opt_out`, `tag`, `speed` (accepted,
ignored). `callback` / `callback_method` are refused: this server answers in the response, it does not
call out. The response streams the audio as it is encoded; headers `content-type`, `dg-request-id`,
`dg-model-name`, `dg-char-count`. Errors: `{"err_code", "err_msg", "request_id"}` with the status
protocols/http_speech.py chooses (400 for a bad request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import parse_speed
from agent_server.core.routing import LANGUAGE_NOT_SERVED, MODEL_NOT_SERVED, Routed, Router
from agent_server.core.session import Context
from agent_server.core.transport import Head
from agent_server.errors import BAD_REQUEST, FieldError, empty_message
from agent_server.protocols.common import load_object, make_spec, parse_seed, resolve_voice, route
from agent_server.protocols.deepgram import DEFAULT_MODEL
from agent_server.protocols.http_speech import STATUS_BAD_REQUEST, HttpSpeechProtocol, HttpSpeechRequest
from agent_server.protocols.vendor_formats import deepgram_format

QUERY_FIELDS = frozenset(
    {"model", "encoding", "container", "sample_rate", "bit_rate", "seed", "mip_opt_out", "tag", "speed",
     "callback", "callback_method"}
)
REFUSED_QUERY = ("callback", "callback_method")
BODY_FIELDS = frozenset({"text"})


@dataclass(frozen=True, slots=True)
class SpeakRequest:
    text: str
    model: str  # the voice too (common.resolve_voice), and its last part the language (aura-2-celeste-es)
    routed: Routed
    seed: int | None
    output: StreamFormat
    speed: float = 1.0


def parse_request(query: Mapping[str, str], body: object, router: Router) -> SpeakRequest:
    """Raises FieldError; `error_body` renders it."""
    for name in REFUSED_QUERY:
        if query.get(name):
            raise FieldError(name, f"{name} is not served: the audio comes back in the response")
    model = query.get("model") or DEFAULT_MODEL
    routed = route(router, model_field="model", model=model)
    output = deepgram_format(query, rest=True)
    obj = load_object(body, BODY_FIELDS, what="body")
    text = obj.get("text")
    if text is not None and not isinstance(text, str):
        raise FieldError("text", "text must be a string")
    if text is None or not text.strip():
        raise empty_message()
    return SpeakRequest(text=text, model=model, routed=routed, seed=parse_seed("seed", query.get("seed")),
                        output=output, speed=parse_speed("speed", query.get("speed")))


def error_body(exc: FieldError, request_id: str) -> tuple[int, dict[str, Any]]:
    """A refused request (400): a parameter at fault is named in the message."""
    if exc.code in (MODEL_NOT_SERVED, LANGUAGE_NOT_SERVED):  # the model names the language too: say which field
        return STATUS_BAD_REQUEST, status_body(exc.code.upper(), f"{exc.field}: {exc.message}", request_id)
    if exc.code != BAD_REQUEST:
        return STATUS_BAD_REQUEST, status_body(exc.code.upper(), exc.message, request_id)
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


# ---- the protocol --------------------------------------------------------------------------------

SpeakContext = Context[SpeakRequest]


class DeepgramSpeakProtocol(HttpSpeechProtocol[SpeakRequest]):
    name: ClassVar[str] = "deepgram_http"

    def parse(self, body: bytes) -> HttpSpeechRequest[SpeakRequest]:
        session = self.session
        request = parse_request(session.transport.query, body, session.port.router)
        spec = make_spec(session.port, voice_id=resolve_voice(session.port, request.model),
                         output_format=request.output, seed=request.seed, routed=request.routed,
                         speed=request.speed)
        return HttpSpeechRequest(spec, request.text, request)

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        if status == STATUS_BAD_REQUEST:
            status, body = error_body(FieldError(field or "", message, code), self.session.session_id)
        else:
            body = status_body(code.upper(), message, self.session.session_id)
        return status, orjson.dumps(body)

    def head(self, ctx: SpeakContext) -> Head:
        headers = response_headers(ctx.state, self.session.session_id)
        media_type = headers.pop("content-type")
        return Head(200, media_type, tuple(headers.items()))
