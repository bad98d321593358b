"""The wire protocols (floor 4 of docs/architecture.md): the native one (native.py, its messages native_wire.py,
its Twilio Media Streams mode twilio.py) and drop-in endpoints for the clients voice agents and telephony
platforms already use: ElevenLabs, Cartesia, Deepgram and OpenAI (WebSocket and HTTP), jambonz (HTTP and
WebSocket) and, on the gRPC port, NVIDIA Riva (riva.py, riva_service.py).

Each module is its wire format only: a `WireProtocol` on the session core (core/session.py), the HTTP ones on
their one base (http_speech.py); what they share is common.py (models, voices, seeds, specs) and
vendor_formats.py (each vendor's names for its audio formats); catalog.py lists, clones and deletes voices and
lists models in each vendor's shape. A protocol sees the session's verbs and `session.port` (core/port.py),
never the hub. `docs/compatibility.md` lists every field and the base-URL settings.
"""

from __future__ import annotations

from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute
from starlette.types import Scope

from agent_server.core.session import http_route, websocket_route
from agent_server.core.voices import VoiceError
from agent_server.protocols import (
    cartesia,
    cartesia_http,
    catalog,
    deepgram,
    deepgram_http,
    elevenlabs,
    elevenlabs_dialogue,
    elevenlabs_http,
    jambonz,
    openai_speech,
)

ELEVENLABS_TTS = "/v1/text-to-speech/{voice_id}"
ELEVENLABS_DIALOGUE = "/v1/text-to-dialogue"
JAMBONZ_HTTP_PATH = "/v1/jambonz/tts"
JAMBONZ_STREAM_PATH = "/v1/jambonz/stream"


def routes() -> list[BaseRoute]:
    return [
        websocket_route(ELEVENLABS_TTS + "/stream-input", elevenlabs.ElevenLabsProtocol),
        websocket_route(ELEVENLABS_TTS + "/multi-stream-input", elevenlabs.MultiStreamProtocol),
        http_route(ELEVENLABS_TTS, elevenlabs_http.ElevenLabsHttpProtocol),
        http_route(ELEVENLABS_TTS + "/stream", elevenlabs_http.ElevenLabsStreamProtocol),
        http_route(ELEVENLABS_TTS + "/with-timestamps", elevenlabs_http.ElevenLabsWithTimestampsProtocol),
        http_route(ELEVENLABS_TTS + "/stream/with-timestamps", elevenlabs_http.ElevenLabsStreamWithTimestampsProtocol),
        websocket_route(ELEVENLABS_DIALOGUE + "/stream-input", elevenlabs_dialogue.DialogueProtocol),
        websocket_route(ELEVENLABS_DIALOGUE + "/multi-stream-input", elevenlabs_dialogue.MultiDialogueProtocol),
        http_route(ELEVENLABS_DIALOGUE, elevenlabs_dialogue.DialogueHttpProtocol),
        http_route(ELEVENLABS_DIALOGUE + "/stream", elevenlabs_dialogue.DialogueStreamProtocol),
        http_route(ELEVENLABS_DIALOGUE + "/with-timestamps", elevenlabs_dialogue.DialogueWithTimestampsProtocol),
        http_route(ELEVENLABS_DIALOGUE + "/stream/with-timestamps",
                   elevenlabs_dialogue.DialogueStreamWithTimestampsProtocol),
        websocket_route("/tts/websocket", cartesia.CartesiaProtocol),
        http_route("/tts/bytes", cartesia_http.CartesiaBytesProtocol),
        http_route("/tts/sse", cartesia_http.CartesiaSseProtocol),
        # one path, two routes: Starlette matches a WebSocket handshake and a POST by the request's type
        websocket_route("/v1/speak", deepgram.DeepgramProtocol),
        http_route("/v1/speak", deepgram_http.DeepgramSpeakProtocol),
        http_route("/v1/audio/speech", openai_speech.OpenAISpeechProtocol),
        http_route(JAMBONZ_HTTP_PATH, jambonz.JambonzHttpProtocol),
        websocket_route(JAMBONZ_STREAM_PATH, jambonz.JambonzStreamProtocol),
        *catalog.routes(),
    ]


def vendor_of_path(scope: Scope) -> catalog.Vendor | Literal["jambonz"] | None:
    """Whose endpoint a request (or handshake) is for: the vendor whose error shape its client parses. None: a
    native path. `/v1/models` is three vendors' path, `/v1/voices` native and ElevenLabs': the client's headers
    say which (`catalog.vendor_of`)."""
    path: str = scope["path"]
    if path.startswith(("/v1/text-to-speech/", ELEVENLABS_DIALOGUE, "/v2/voices", "/v1/voices/add")):
        return "elevenlabs"
    if path == "/voices" or path.startswith(("/voices/", "/tts/")):
        return "cartesia"
    if path == "/v1/speak":
        return "deepgram"
    if path.startswith("/v1/audio/"):
        return "openai"
    if path.startswith("/v1/jambonz/"):
        return "jambonz"
    if path == "/v1/models" or path.startswith("/v1/models/"):
        return catalog.vendor_of(Request(scope))
    if path == "/v1/voices" or path.startswith("/v1/voices/"):  # native routes that ElevenLabs' SDK calls too
        return "elevenlabs" if catalog.vendor_of(Request(scope)) == "elevenlabs" else None
    return None


def refusal_response(scope: Scope, status_code: int, code: str, message: str) -> JSONResponse | None:
    """An access refusal (auth.AuthMiddleware: 401, 403) in the shape of the vendor whose path was asked for, so
    its SDK reports our message; None on native paths (auth's own shape)."""
    vendor = vendor_of_path(scope)
    if vendor is None:
        return None
    if vendor == "jambonz":
        return JSONResponse(jambonz.http_error_body(message, code), status_code=status_code)
    return catalog.error_response(vendor, VoiceError(status_code, "", message, code))
