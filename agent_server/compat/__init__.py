"""Drop-in endpoints for the clients voice agents already use (ElevenLabs, Cartesia, Deepgram, OpenAI).

Each module is its vendor's wire format only: a `WireProtocol` on the session core
(agent_server/session.py), which every protocol shares with the native one; `docs/compatibility.md`
lists every field and the base-URL settings.
"""

from __future__ import annotations

from starlette.routing import BaseRoute

from agent_server.compat import cartesia, deepgram, elevenlabs, openai_speech
from agent_server.session import http_route, websocket_route


def routes() -> list[BaseRoute]:
    return [
        websocket_route("/v1/text-to-speech/{voice_id}/stream-input", elevenlabs.ElevenLabsProtocol),
        websocket_route("/v1/text-to-speech/{voice_id}/multi-stream-input", elevenlabs.MultiStreamProtocol),
        websocket_route("/tts/websocket", cartesia.CartesiaProtocol),
        websocket_route("/v1/speak", deepgram.DeepgramProtocol),
        http_route("/v1/audio/speech", openai_speech.OpenAISpeechProtocol),
    ]
