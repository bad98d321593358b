"""The vendors' catalog endpoints: voices listed, read, cloned and deleted, and models listed, in the shapes
each vendor's SDK parses, over the one voice store (agent_server/core/voices.py: the native `/v1/voices` routes
act on the same voices).

| vendor     | route                                       | SDK call                                   |
|------------|---------------------------------------------|--------------------------------------------|
| ElevenLabs | `GET /v1/models`                            | `models.list`                              |
| ElevenLabs | `GET /v2/voices`                            | `voices.search`                            |
| ElevenLabs | `POST /v1/voices/add`                       | `voices.ivc.create`                        |
| Cartesia   | `GET /voices`, `GET /voices/{id}`           | `voices.list` (cursor pages), `voices.get` |
| Cartesia   | `POST /voices/clone`, `DELETE /voices/{id}` | `voices.clone`, `voices.delete`            |
| OpenAI     | `GET /v1/models`, `GET /v1/models/{id}`     | `models.list`, `models.retrieve`           |
| Deepgram   | `GET /v1/models`, `GET /v1/models/{id}`     | `manage.v1.models.list`, `.get`            |

ElevenLabs' `GET /v1/voices`, `GET /v1/voices/{id}` and `DELETE /v1/voices/{id}` are the native routes (their
JSON has the `voice_id` and `name` the SDK reads).

`GET /v1/models` is three vendors' path; it answers in the shape of the client asking (`vendor_of`: ElevenLabs'
SDK sends `xi-api-key`, Deepgram's `Authorization: Token`; anything else gets OpenAI's list, the shape generic
OpenAI-compatible tools probe for).

A model is the variant this server runs (one per server), `chatterbox-<variant>`; the speech endpoints also take
any vendor's model name and mean it (protocols/common.py). Deepgram's model names its voice (`aura-2-thalia-en`),
so its list has one TTS model per voice, as Deepgram's own does; `canonical_name` is the voice id, which
`/v1/speak?model=` selects.

Cloning takes one WAV clip (5-60 s; `voices.decode_wav`), a name, and optionally a description and a language
(ISO 639; it describes the clip: a voice speaks whatever language a request asks for). What a vendor's clone call
can carry and this server cannot honour (several ElevenLabs samples, `labels`, `remove_background_noise=true`,
Cartesia's `accent` and `base_voice_id`) is refused, naming the field; a list filter on something voices do not
have here (gender, accent, ...) is refused likewise. Errors are each vendor's own shape.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agent_server.core.port import port_of
from agent_server.core.voices import (
    Voice,
    VoiceError,
    VoiceStore,
    form_fields,
    read_body,
    read_form,
)
from agent_server.errors import FieldError
from agent_server.fleet.auth import ANONYMOUS, QUERY_NAMES, principal_of
from agent_server.protocols.common import is_decimal, query_flag
from synth.api import LANGUAGE_NAMES, Variant, languages_of

Vendor = Literal["elevenlabs", "cartesia", "openai", "deepgram"]
STATUS_OK = 200
STATUS_NO_CONTENT = 204
STATUS_BAD_REQUEST = 400
STATUS_NOT_FOUND = 404
STATUS_UNPROCESSABLE = 422
STATUS_SERVER_ERROR = 500
OWNER = "resemble-ai"  # who made the model (OpenAI's `owned_by`)
MAX_PAGE_SIZE = 100
ELEVENLABS_PAGE_SIZE = 10  # ElevenLabs' default
CARTESIA_PAGE_SIZE = 10  # Cartesia's default
CREDENTIALS = frozenset(QUERY_NAMES) | {"xi_api_key"}  # auth.py reads these; never refused as unknown
UUID_NAMESPACE = uuid.UUID("6f0b7a52-3c1e-4d1b-9a57-2f3c1f0e8b11")  # Deepgram's model uuid: uuid5(this, voice@version)


# ---- who is asking, and the errors in their shape -------------------------------------------------------


def vendor_of(request: Request) -> Vendor:
    """Whose `/v1/models` a request wants, from what its SDK sends (ElevenLabs: `xi-api-key`; Deepgram:
    `Authorization: Token`); OpenAI's otherwise."""
    headers = request.headers
    sdk = headers.get("x-fern-sdk-name", "").lower()
    if "xi-api-key" in headers or "xi_api_key" in request.query_params or sdk.startswith("elevenlabs"):
        return "elevenlabs"
    if headers.get("authorization", "").lower().startswith("token ") or sdk.startswith("deepgram"):
        return "deepgram"
    return "openai"


TITLES = {400: "Invalid request", 401: "Unauthorized", 403: "Forbidden", 404: "Not found", 409: "Conflict",
          413: "Request too large", 422: "Unprocessable", 503: "Service unavailable"}


def error_response(vendor: Vendor, exc: VoiceError, request_id: str = "") -> JSONResponse:
    status, field, message, code = exc.status_code, exc.field, exc.message, exc.code
    body: dict[str, Any]
    if vendor == "elevenlabs":
        if status in (STATUS_BAD_REQUEST, STATUS_UNPROCESSABLE):  # FastAPI's validation shape, as ElevenLabs
            status = STATUS_UNPROCESSABLE
            body = {"detail": [{"loc": ["body", field], "msg": message, "type": code}]}
        else:
            body = {"detail": {"status": "voice_not_found" if status == STATUS_NOT_FOUND else code,
                               "message": message}}
    elif vendor == "cartesia":
        body = {"title": TITLES.get(status, "Error"), "message": message, "error_code": code, "status_code": status,
                "request_id": request_id}
    elif vendor == "deepgram":
        body = {"err_code": code.upper(), "err_msg": message, "request_id": request_id}
    else:
        kind = "invalid_request_error" if status < STATUS_SERVER_ERROR else "server_error"
        body = {"error": {"message": message, "type": kind, "param": field or None,
                          "code": "model_not_found" if status == STATUS_NOT_FOUND else code}}
    return JSONResponse(body, status_code=status)


def _handled(vendor: Vendor | None, handler: Callable[[Request, Vendor], Any]) -> Callable[[Request], Any]:
    """A route: `handler`'s refusals answered in `vendor`'s shape (None: the shape `vendor_of` picks)."""

    async def endpoint(request: Request) -> Response:
        who = vendor or vendor_of(request)
        try:
            response: Response = await handler(request, who)
        except VoiceError as exc:
            return error_response(who, exc, uuid.uuid4().hex)
        except FieldError as exc:  # a shared parser's refusal (common.query_flag): a bad request
            refused = VoiceError(STATUS_BAD_REQUEST, exc.field, exc.message, exc.code)
            return error_response(who, refused, uuid.uuid4().hex)
        return response

    return endpoint


# ---- what every vendor reads: the store, the variant, the query ---------------------------------------------


def _store(request: Request) -> VoiceStore:
    return port_of(request).voices


def _variant(request: Request) -> Variant:
    return port_of(request).model.variant


def model_id(variant: Variant) -> str:
    return f"chatterbox-{variant}"


def model_name(variant: Variant) -> str:
    return f"Chatterbox {variant.capitalize()}"


def _query(request: Request, allowed: frozenset[str], unsupported: frozenset[str] = frozenset()) -> dict[str, str]:
    """The query (credentials left out); a parameter not in `allowed` is refused, one in `unsupported` as a
    filter voices here cannot answer."""
    query: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name in CREDENTIALS:
            continue
        if name in unsupported:
            raise VoiceError(STATUS_BAD_REQUEST, name, f"{name!r} is not supported here: voices on this server "
                               "have a name, a description and a language")
        if name not in allowed:
            raise VoiceError(STATUS_BAD_REQUEST, name, f"unknown query parameter {name!r}")
        query[name] = value
    return query


def _page_size(field: str, raw: str | None, default: int) -> int:
    if raw is None or raw == "":
        return default
    if not is_decimal(raw) or not 1 <= int(raw) <= MAX_PAGE_SIZE:
        raise VoiceError(STATUS_BAD_REQUEST, field, f"{field} must be an integer from 1 to {MAX_PAGE_SIZE}")
    return int(raw)


def _matches(voice: Voice, search: str) -> bool:
    needle = search.lower()
    return any(needle in text.lower() for text in (voice.voice_id, voice.name, voice.description))


def _unix_s(iso: str) -> int | None:
    try:
        return int(datetime.fromisoformat(iso).timestamp())
    except ValueError:
        return None


def _display_name(voice: Voice) -> str:
    return voice.name or voice.voice_id


async def _clone(request: Request, *, text: frozenset[str], file_field: str, max_files: int,
                 check: Callable[[dict[str, str], int], None]) -> tuple[Voice, dict[str, str]]:
    """A voice from a multipart upload: `check(fields, number of files)` refuses what cannot be honoured."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise VoiceError(STATUS_BAD_REQUEST, file_field, "send multipart/form-data with the clip in "
                           f"`{file_field}`")
    body = await read_body(request, port_of(request).settings.max_voice_upload_bytes)
    async with read_form(request, body, max_files=max_files) as form:
        fields = form_fields(form, text, frozenset({file_field}))
        uploads = form.getlist(file_field)
        check(fields, len(uploads))
        if not uploads or isinstance(uploads[0], str):
            raise VoiceError(STATUS_BAD_REQUEST, file_field, f"a WAV clip in `{file_field}` is required")
        clip = await uploads[0].read()
    if not fields.get("name", "").strip():
        raise VoiceError(STATUS_BAD_REQUEST, "name", "a voice needs a name")
    voice = await _store(request).create(clip, name=fields["name"], description=fields.get("description", ""),
                                         language=fields.get("language", ""))
    return voice, fields


# ---- models ---------------------------------------------------------------------------------------------


async def list_models(request: Request, vendor: Vendor) -> Response:
    """Every loaded model (the default first), each with the model names that reach it (`routes`: the route table
    in force, core/routing.py; OpenAI's list also carries the whole table). Deepgram's lists voices (its model
    names a voice), in its own shape only."""
    port = port_of(request)
    router = port.router
    if vendor == "elevenlabs":
        _query(request, frozenset())
        max_chars = port.settings.max_context_text_chars
        return JSONResponse([elevenlabs_model(m, max_chars, router.names_served_by(m)) for m in router.loaded])
    if vendor == "deepgram":
        _query(request, frozenset({"include_outdated"}))
        return JSONResponse({"stt": [], "tts": [deepgram_model(v, _variant(request)) for v in _store(request).list()]})
    _query(request, frozenset())
    created_unix_s = _store(request).attached_unix_s
    return JSONResponse({"object": "list", "data": [openai_model(m, created_unix_s, router.names_served_by(m))
                                                    for m in router.loaded], "routes": router.table.to_json()})


async def get_model(request: Request, vendor: Vendor) -> Response:
    wanted, router = request.path_params["model_id"], port_of(request).router
    if vendor == "deepgram":
        _query(request, frozenset())
        for voice in _store(request).list():
            model = deepgram_model(voice, _variant(request))
            if wanted in (model["uuid"], model["canonical_name"]):
                return JSONResponse(model)
    elif vendor == "openai":
        _query(request, frozenset())
        for loaded in router.loaded:
            if wanted == model_id(loaded):
                return JSONResponse(openai_model(loaded, _store(request).attached_unix_s,
                                                 router.names_served_by(loaded)))
    runs = ", ".join(repr(model_id(m)) for m in router.loaded)
    raise VoiceError(STATUS_NOT_FOUND, "model", f"the model {wanted!r} does not exist on this server "
                       f"(it runs {runs})", "not_found")


def elevenlabs_model(variant: Variant, max_chars: int, routes: list[str]) -> dict[str, Any]:
    return {
        "model_id": model_id(variant),
        "name": model_name(variant),
        "description": f"Resemble AI's Chatterbox ({variant}), served by agent-server",
        "can_be_finetuned": False,
        "can_do_text_to_speech": True,
        "can_do_voice_conversion": False,
        "can_use_style": False,
        "can_use_speaker_boost": False,
        "serves_pro_voices": False,
        "requires_alpha_access": False,
        "token_cost_factor": 1.0,
        "max_characters_request_free_user": max_chars,
        "max_characters_request_subscribed_user": max_chars,
        "maximum_text_length_per_request": max_chars,
        "languages": [{"language_id": code, "name": LANGUAGE_NAMES[code]} for code in languages_of(variant)],
        "routes": routes,  # (ours) the model names a request reaches this model with
    }


def openai_model(variant: Variant, created_unix_s: int, routes: list[str]) -> dict[str, Any]:
    return {"id": model_id(variant), "object": "model", "created": created_unix_s, "owned_by": OWNER,
            "routes": routes}


def deepgram_model(voice: Voice, variant: Variant) -> dict[str, Any]:
    return {
        "name": _display_name(voice),
        "canonical_name": voice.voice_id,
        "architecture": model_id(variant),
        "languages": [voice.language] if voice.language else list(languages_of(variant)),
        "version": voice.version,
        "uuid": str(uuid.uuid5(UUID_NAMESPACE, f"{voice.voice_id}@{voice.version}")),
        "metadata": {"accent": None, "color": None, "image": None, "sample": None, "tags": [], "use_cases": []},
    }


# ---- ElevenLabs -------------------------------------------------------------------------------------------


ELEVENLABS_SEARCH = frozenset({"next_page_token", "page_size", "search", "sort", "sort_direction", "voice_type",
                               "category", "include_total_count", "voice_ids", "language"})
ELEVENLABS_UNSUPPORTED = frozenset({"fine_tuning_state", "collection_id", "gender", "age", "accent", "use_cases",
                                    "min_notice_period_days", "include_custom_rates", "include_live_moderated",
                                    "high_quality"})
# voice_type -> is a voice of that type built in (True), uploaded (False); absent: matches no voice here
ELEVENLABS_VOICE_TYPES: Mapping[str, bool] = {"default": True, "personal": False, "workspace": False,
                                              "non-default": False}
ELEVENLABS_CATEGORIES: Mapping[str, bool] = {"premade": True, "cloned": False}
ELEVENLABS_OTHER_TYPES = frozenset({"community", "saved"})
ELEVENLABS_OTHER_CATEGORIES = frozenset({"generated", "professional", "famous", "high_quality"})


async def elevenlabs_search(request: Request, vendor: Vendor) -> Response:
    query = _query(request, ELEVENLABS_SEARCH, ELEVENLABS_UNSUPPORTED)
    voices = _store(request).list()
    if query.get("search"):
        voices = [v for v in voices if _matches(v, query["search"])]
    wanted_ids = request.query_params.getlist("voice_ids")
    if wanted_ids:
        voices = [v for v in voices if v.voice_id in wanted_ids]
    for field, kinds, others in (("voice_type", ELEVENLABS_VOICE_TYPES, ELEVENLABS_OTHER_TYPES),
                                 ("category", ELEVENLABS_CATEGORIES, ELEVENLABS_OTHER_CATEGORIES)):
        raw = query.get(field)
        if raw:
            if raw not in kinds and raw not in others:
                raise VoiceError(STATUS_BAD_REQUEST, field, f"{field} must be one of "
                                   f"{sorted({*kinds, *others})} (got {raw!r})")
            voices = [v for v in voices if kinds.get(raw) == v.builtin]
    if query.get("language"):
        voices = [v for v in voices if v.language == query["language"].lower()]
    sort = query.get("sort") or "created_at_unix"
    if sort not in ("created_at_unix", "name"):
        raise VoiceError(STATUS_BAD_REQUEST, "sort", f"sort must be created_at_unix or name (got {sort!r})")
    direction = query.get("sort_direction") or "desc"
    if direction not in ("asc", "desc"):
        raise VoiceError(STATUS_BAD_REQUEST, "sort_direction", f"sort_direction must be asc or desc "
                           f"(got {direction!r})")
    if sort == "name":
        voices.sort(key=lambda v: (_display_name(v).lower(), v.voice_id), reverse=direction == "desc")
    else:
        voices.sort(key=lambda v: (v.created_at, v.voice_id), reverse=direction == "desc")
    size = _page_size("page_size", query.get("page_size"), ELEVENLABS_PAGE_SIZE)
    token = query.get("next_page_token") or "0"
    if not is_decimal(token):
        raise VoiceError(STATUS_BAD_REQUEST, "next_page_token", f"not a page token of this server: {token!r}")
    start = int(token)
    page = voices[start:start + size]
    more = start + size < len(voices)
    query_flag(query, "include_total_count")  # checked; the count is cheap: always given
    model = model_id(_variant(request))
    return JSONResponse({"voices": [elevenlabs_voice(v, model) for v in page], "has_more": more,
                         "total_count": len(voices), "next_page_token": str(start + size) if more else None})


def elevenlabs_voice(voice: Voice, model: str) -> dict[str, Any]:
    return {
        "voice_id": voice.voice_id,
        "name": _display_name(voice),
        "category": "premade" if voice.builtin else "cloned",
        "description": voice.description or None,
        "labels": {"language": voice.language} if voice.language else {},
        "created_at_unix": _unix_s(voice.created_at),
        "is_owner": not voice.builtin,
        "high_quality_base_model_ids": [model],
        "preview_url": None,
        "samples": None,
        "settings": None,
    }


ELEVENLABS_CLONE = frozenset({"name", "description", "labels", "remove_background_noise"})


def _elevenlabs_clone_check(fields: dict[str, str], n_files: int) -> None:
    if n_files > 1:
        raise VoiceError(STATUS_BAD_REQUEST, "files", f"one sample per voice here ({n_files} given): send the "
                           "best 5-60 s WAV clip")
    if fields.get("labels", "null") not in ("null", "{}", ""):
        raise VoiceError(STATUS_BAD_REQUEST, "labels", "labels are not supported here: voices on this server "
                           "have a name, a description and a language")
    if query_flag(fields, "remove_background_noise"):
        raise VoiceError(STATUS_BAD_REQUEST, "remove_background_noise", "this server does not remove background "
                           "noise: send a clean clip")


async def elevenlabs_clone(request: Request, vendor: Vendor) -> Response:
    _query(request, frozenset())
    voice, _ = await _clone(request, text=ELEVENLABS_CLONE, file_field="files", max_files=25,
                            check=_elevenlabs_clone_check)
    return JSONResponse({"voice_id": voice.voice_id, "requires_verification": False})


# ---- Cartesia ---------------------------------------------------------------------------------------------


CARTESIA_LIST = frozenset({"limit", "starting_after", "ending_before", "q", "is_owner", "expand[]"})
CARTESIA_UNSUPPORTED = frozenset({"gender"})


async def cartesia_list(request: Request, vendor: Vendor) -> Response:
    query = _query(request, CARTESIA_LIST, CARTESIA_UNSUPPORTED)
    for expand in request.query_params.getlist("expand[]"):
        if expand != "preview_file_url":
            raise VoiceError(STATUS_BAD_REQUEST, "expand[]", f"cannot expand {expand!r}")
    voices = sorted(_store(request).list(), key=lambda v: v.voice_id)  # cursors are voice ids: order by them
    if query.get("q"):
        voices = [v for v in voices if _matches(v, query["q"])]
    if query.get("is_owner"):
        owner = query_flag(query, "is_owner")
        voices = [v for v in voices if (not v.builtin) == owner]
    size = _page_size("limit", query.get("limit"), CARTESIA_PAGE_SIZE)
    after, before = query.get("starting_after"), query.get("ending_before")
    if after and before:
        raise VoiceError(STATUS_BAD_REQUEST, "ending_before", "give starting_after or ending_before, not both")
    if before:  # the page just before the cursor (ids compare as strings, so a deleted cursor still works)
        earlier = [v for v in voices if v.voice_id < before]
        page, more = earlier[-size:], len(earlier) > size
    else:
        later = [v for v in voices if not after or v.voice_id > after]
        page, more = later[:size], len(later) > size
    return JSONResponse({"data": [cartesia_voice(v) for v in page], "has_more": more})


async def cartesia_get(request: Request, vendor: Vendor) -> Response:
    _query(request, frozenset({"expand[]"}))
    return JSONResponse(cartesia_voice(_store(request).get(request.path_params["voice_id"])))


async def cartesia_delete(request: Request, vendor: Vendor) -> Response:
    _query(request, frozenset())
    await _store(request).delete(request.path_params["voice_id"])
    return Response(status_code=STATUS_NO_CONTENT)


CARTESIA_CLONE = frozenset({"name", "description", "language", "accent", "base_voice_id"})


def _cartesia_clone_check(fields: dict[str, str], n_files: int) -> None:
    for field in ("accent", "base_voice_id"):
        if fields.get(field):
            raise VoiceError(STATUS_BAD_REQUEST, field, f"{field} is not supported here: a voice is cloned "
                               "from its clip alone")
    if not fields.get("language"):
        raise VoiceError(STATUS_BAD_REQUEST, "language", "the clip's language is required (e.g. \"en\")")


async def cartesia_clone(request: Request, vendor: Vendor) -> Response:
    _query(request, frozenset())
    voice, _ = await _clone(request, text=CARTESIA_CLONE, file_field="clip", max_files=1, check=_cartesia_clone_check)
    principal = principal_of(request.scope)
    metadata = {key: value for key, value in cartesia_voice(voice).items() if key in CARTESIA_METADATA}
    metadata["user_id"] = principal.key_id if principal is not None else ANONYMOUS  # the key's fingerprint
    return JSONResponse(metadata)


CARTESIA_METADATA = frozenset({"id", "access", "created_at", "description", "language", "name", "tagline",
                               "visibility"})


def cartesia_voice(voice: Voice) -> dict[str, Any]:
    return {
        "id": voice.voice_id,
        "name": _display_name(voice),
        "description": voice.description,
        "language": voice.language or "en",
        "locales": [{"locale": voice.language, "is_native": True}] if voice.language else [],
        "created_at": voice.created_at,
        "is_owner": not voice.builtin,
        "is_public": voice.builtin,
        "access": "public" if voice.builtin else "private",
        "visibility": "all" if voice.builtin else "owner",
        "tagline": "",
        "gender": None,
        "preview_file_url": None,
    }


# ---- routes -----------------------------------------------------------------------------------------------


def routes() -> Sequence[Route]:
    return [
        Route("/v1/models", _handled(None, list_models), methods=["GET"]),
        Route("/v1/models/{model_id}", _handled(None, get_model), methods=["GET"]),
        Route("/v2/voices", _handled("elevenlabs", elevenlabs_search), methods=["GET"]),
        Route("/v1/voices/add", _handled("elevenlabs", elevenlabs_clone), methods=["POST"]),
        Route("/voices", _handled("cartesia", cartesia_list), methods=["GET"]),
        Route("/voices/clone", _handled("cartesia", cartesia_clone), methods=["POST"]),
        Route("/voices/{voice_id}", _handled("cartesia", cartesia_get), methods=["GET"]),
        Route("/voices/{voice_id}", _handled("cartesia", cartesia_delete), methods=["DELETE"]),
    ]
