"""`POST /v1/jobs` bodies -> `JobRequest`, or a `JobError` naming the field. Pure: no I/O.

    {"text": "...",                      required: 1..max_job_chars characters with something to say
     "voice": "default",                 as the native protocol's `open` (and checked by its parser)
     "output_format": "pcm",             mp3 | opus | aac | flac | wav | pcm (the HTTP endpoints' names, 24 kHz)
     "seed": 42, "sampling": {...},      as the native `open`; no seed: one is drawn at submission
     "language": "fr",                   as the native `open`
     "webhook_url": "https://..."}       http(s); where it may point is the operator's (jobs/webhooks.py)

400: the body is not a JSON object. 422: a field is wrong (missing, mistyped, out of range, unknown): the
error names it, in the native HTTP error shape `{"error": {"field", "message", "code"}}`.

`voice`, `seed`, `sampling` and `language` are checked by the native protocol's own parser (`protocol.parse` of
the `open` message they would make) and `speech.build_params`, so a job accepts exactly what a live context does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from agent_server.audio.codecs import StreamFormat
from agent_server.core.events import build_params
from agent_server.core.outcomes import Outcome, http_status
from agent_server.core.routing import DEFAULT_ROUTES, Routed, Router
from agent_server.errors import BAD_REQUEST, EMPTY_MESSAGE, TEXT_TOO_LONG, FieldError
from agent_server.jobs.model import STATUS_UNPROCESSABLE, JobError
from agent_server.protocols import native_wire as wire
from agent_server.protocols.vendor_formats import OPENAI_FORMATS, openai_format

STATUS_BAD_REQUEST = http_status(Outcome.BAD_INPUT)
DEFAULT_MAX_JOB_CHARS = 200_000
DEFAULT_OUTPUT_FORMAT = "pcm"  # the native protocol's default: PCM16 at 24 kHz
JOB_FORMATS: tuple[str, ...] = tuple(OPENAI_FORMATS)  # mp3, opus, aac, flac, wav, pcm: every one at 24 kHz
MAX_WEBHOOK_URL_CHARS = 2048
WEBHOOK_SCHEMES = ("http", "https")
NOTHING_TO_SAY = "nothing_to_say"
# the fields the native `open` message has under the same name and meaning
OPEN_FIELDS = ("voice", "seed", "sampling", "language")
BODY_FIELDS = frozenset({"text", "output_format", "webhook_url", *OPEN_FIELDS})

# A job's language -> the loaded model that speaks it (and the language it is asked in), as the native protocol
# routes a context without a model name (core/routing.py); raises FieldError (`language_not_served`).
LanguageRoute = Callable[[str | None], Routed]


def one_model(variant: str) -> LanguageRoute:
    """The route of a server that loaded one model (the tests')."""
    router = Router(DEFAULT_ROUTES, (variant,))  # type: ignore[arg-type]  # (a Variant name; checked by the router)
    return lambda language: router.route(language=language)


@dataclass(frozen=True, slots=True)
class JobRequest:
    text: str
    voice: str = "default"
    output_format: str = DEFAULT_OUTPUT_FORMAT
    seed: int | None = None
    sampling: tuple[tuple[str, float | int], ...] = ()
    language: str | None = None
    webhook_url: str | None = None


def job_format(name: object, field: str = "output_format") -> StreamFormat:
    """A job format name -> the stream format its audio is assembled in. Raises JobError(422) naming `field`."""
    try:
        return openai_format(DEFAULT_OUTPUT_FORMAT if name is None else name)
    except FieldError:
        raise JobError(STATUS_UNPROCESSABLE, field, f"must be one of {', '.join(JOB_FORMATS)} (got {name!r})",
                       BAD_REQUEST) from None


def parse_job_request(body: bytes, *, route: LanguageRoute, max_job_chars: int = DEFAULT_MAX_JOB_CHARS) -> JobRequest:
    """Raises JobError (400 for a body that is no JSON object, 422 for a field at fault: a language no loaded model
    speaks among them)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise JobError(STATUS_BAD_REQUEST, "body", f"malformed JSON: {exc}", BAD_REQUEST) from None
    if not isinstance(obj, dict):
        raise JobError(STATUS_BAD_REQUEST, "body", "the body must be a JSON object", BAD_REQUEST)
    unknown = sorted(set(obj) - BODY_FIELDS)
    if unknown:
        raise _unprocessable(unknown[0], "unknown field: the fields are " + ", ".join(sorted(BODY_FIELDS)))
    text = _text(obj.get("text"), max_job_chars)
    output_format = DEFAULT_OUTPUT_FORMAT if obj.get("output_format") is None else obj["output_format"]
    job_format(output_format)
    opened = _open_fields(obj, route)
    return JobRequest(
        text=text,
        voice=opened.voice,
        output_format=str(output_format),
        seed=opened.seed,
        sampling=opened.sampling,
        language=opened.language,
        webhook_url=_webhook_url(obj.get("webhook_url")),
    )


def _text(value: object, max_job_chars: int) -> str:
    if value is None:
        raise _unprocessable("text", "required: the text to say", EMPTY_MESSAGE)
    if not isinstance(value, str):
        raise _unprocessable("text", "must be a string")
    if len(value) > max_job_chars:
        raise _unprocessable("text", f"{len(value)} characters: at most {max_job_chars} (--max-job-chars)",
                             TEXT_TOO_LONG)
    if not any(ch.isalnum() for ch in value):
        raise _unprocessable("text", "the text has nothing to say (no letter or digit)", NOTHING_TO_SAY)
    return value


def _open_fields(obj: Mapping[str, Any], route: LanguageRoute) -> wire.Open:
    """voice, seed, sampling, language through the native parser and router (one set of rules for live and jobs):
    the sampling is checked against the model the language routes to."""
    message: dict[str, Any] = {"type": "open", "context_id": "job"}
    message.update({name: obj[name] for name in OPEN_FIELDS if obj.get(name) is not None})
    parsed = wire.parse(orjson.dumps(message).decode())
    if isinstance(parsed, FieldError):
        raise _unprocessable(parsed.field, parsed.message, parsed.code)
    if not isinstance(parsed, wire.Open):  # (an `open` parses to Open or an error)
        raise TypeError(f"the native parser made {type(parsed).__name__} of an open message")
    try:
        build_params(route(parsed.language).model, parsed.sampling, parsed.seed)
    except FieldError as error:
        raise _unprocessable(error.field, error.message, error.code) from None
    return parsed


def _webhook_url(value: object) -> str | None:
    """Its form only; where it may point is checked against --webhook-allow when it is resolved."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _unprocessable("webhook_url", "must be an http(s) URL")
    if len(value) > MAX_WEBHOOK_URL_CHARS:
        raise _unprocessable("webhook_url", f"at most {MAX_WEBHOOK_URL_CHARS} characters")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise _unprocessable("webhook_url", f"not a URL: {exc}") from None
    if parts.scheme not in WEBHOOK_SCHEMES:
        raise _unprocessable("webhook_url", f"only http and https URLs (got {parts.scheme or 'none'!r})")
    if not parts.hostname:
        raise _unprocessable("webhook_url", "the URL names no host")
    if parts.username is not None or parts.password is not None:
        raise _unprocessable("webhook_url", "credentials in the URL are not accepted (the body is signed)")
    if port == 0:
        raise _unprocessable("webhook_url", "port 0")
    return value


def _unprocessable(field: str, message: str, code: str = BAD_REQUEST) -> JobError:
    return JobError(STATUS_UNPROCESSABLE, field, message, code)
