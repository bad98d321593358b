"""Drop-in endpoints for the clients voice agents already use (ElevenLabs, Cartesia, Deepgram, OpenAI).

Each module translates its vendor's messages onto `agent_server.speech.SpeechStream`, the same internal
API the native protocol drives; `docs/compatibility.md` lists every field and the base-URL settings.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route, WebSocketRoute

from agent_server.compat import cartesia, deepgram, elevenlabs, openai_speech


def routes() -> list[BaseRoute]:
    return [
        WebSocketRoute("/v1/text-to-speech/{voice_id}/stream-input", elevenlabs.stream_input),
        WebSocketRoute("/v1/text-to-speech/{voice_id}/multi-stream-input", elevenlabs.multi_stream_input),
        WebSocketRoute("/tts/websocket", cartesia.tts_websocket),
        WebSocketRoute("/v1/speak", deepgram.speak),
        Route("/v1/audio/speech", openai_speech.speech, methods=["POST"]),
    ]
