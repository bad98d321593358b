"""One client driver per protocol, for the tests that run the same scenario over every protocol
(test_behaviour.py, test_session.py): how to speak a turn, and how that protocol says busy, error,
done. They drive the app in-process (tests/agent_server/fake_asgi.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette

from agent_server.core.session import Session
from agent_server.core.stream import SpeechStream

from tests.agent_server.fake_asgi import RECV_TIMEOUT_S, FakeHttpRequest, FakeWebSocket

Json = dict[str, Any]


@dataclass(frozen=True)
class Driver:
    name: str  # the protocol's label in metrics and logs
    column: str  # its column in docs/operations.md's behaviour table
    path: str
    query: str = ""
    http: bool = False
    multi: bool = False  # several contexts per session
    greeting: str | None = None  # the "type" of the first message of a session
    bad_request_status: int = 400  # HTTP: a refused request's status (ElevenLabs answers 422)

    def __str__(self) -> str:
        return self.id

    @property
    def id(self) -> str:
        return f"{self.name}{'-multi' if self.multi else ''}"

    # ---- sessions ----------------------------------------------------------------------------------

    async def connect(self, app: Starlette, headers: dict[str, str] | None = None) -> FakeWebSocket:
        ws = FakeWebSocket(app, self.path, self.query, headers)
        await ws.connect()
        if self.greeting is not None:
            first = await ws.next_json()
            if first.get("type") != self.greeting:  # a refusal instead: keep it for the caller
                ws.log.insert(0, orjson.dumps(first).decode())
                ws.received.put_nowait(orjson.dumps(first).decode())
        return ws

    def request(self, app: Starlette, text: str | None, headers: dict[str, str] | None = None,
                extra: Json | None = None) -> FakeHttpRequest:
        """One HTTP request of a turn (`text` None: a body without any; `extra`: more body fields)."""
        field, body = HTTP_BODIES[self.name]
        body = dict(body) | ({} if text is None else {field: text}) | (extra or {})
        request = FakeHttpRequest(app, self.path, body, HTTP_HEADERS.get(self.name, {}) | (headers or {}),
                                  query=self.query)
        request.start()
        return request

    def http_error(self, request: FakeHttpRequest) -> tuple[str, str]:
        """(the error code, lower case; the message) of an HTTP error response, in the vendor's shape."""
        body = request.json()
        if self.name == "openai":
            code, message = body["error"]["code"], body["error"]["message"]
        elif self.name == "elevenlabs_http":
            detail = body["detail"]
            code, message = (detail[0]["type"], detail[0]["msg"]) if isinstance(detail, list) else (
                detail["status"], detail["message"])
        elif self.name == "cartesia_http":
            code, message = body["error_code"], body["message"]
        elif self.name == "deepgram_http":
            code, message = body["err_code"], body["err_msg"]
        else:  # jambonz
            code, message = body["code"], body["error"]
        return str(code).lower(), str(message)

    # ---- client messages -------------------------------------------------------------------------

    def turn(self, cid: str, text: str) -> list[Json]:
        """The messages of a whole turn: open with `text`, then end."""
        return self.text(cid, text, first=True) + self.end(cid)

    def text(self, cid: str, text: str | None, first: bool = False) -> list[Json]:
        """One text piece (None: a message with no text at all), opening the context when `first`."""
        body: Json
        if self.name == "native":
            if first:
                return [{"type": "open", "context_id": cid, "seed": 1, **({} if text is None else {"text": text})}]
            return [{"type": "text", "context_id": cid, **({} if text is None else {"text": text})}]
        if self.name == "elevenlabs":
            body = {} if text is None else {"text": text}
            if self.multi:
                body["context_id"] = cid
            return ([{"text": " ", **({"context_id": cid} if self.multi else {})}] if first else []) + [body]
        if self.name == "cartesia":
            body = {"context_id": cid, "continue": True, "model_id": "sonic-2", "voice": {"mode": "id", "id": "v"}}
            if text is not None:
                body["transcript"] = text
            return [body]
        if self.name == "deepgram":
            return [{"type": "Speak", **({} if text is None else {"text": text})}]
        if self.name == "jambonz":
            return [{"type": "stream", **({} if text is None else {"text": text})}]
        raise AssertionError(self.name)

    def end(self, cid: str) -> list[Json]:
        if self.name == "native":
            return [{"type": "end", "context_id": cid}]
        if self.name == "elevenlabs":
            if self.multi:
                return [{"text": "", "context_id": cid, "flush": True}, {"context_id": cid, "close_context": True}]
            return [{"text": ""}]
        if self.name == "cartesia":
            return [{"context_id": cid, "transcript": "", "continue": False}]
        if self.name == "deepgram":
            return [{"type": "Close"}]
        if self.name == "jambonz":
            return [{"type": "flush"}]  # jambonz has no end of turn: the context lives until `stop`
        raise AssertionError(self.name)

    # ---- what the server says --------------------------------------------------------------------

    def is_turn_done(self, message: Json, cid: str) -> bool:
        if self.name == "native":
            return message.get("type") == "context_done" and message.get("context_id") == cid
        if self.name == "elevenlabs":
            return message.get("isFinal") is True and (not self.multi or message.get("contextId") == cid)
        if self.name == "cartesia":
            return message.get("type") in ("done", "error") and message.get("context_id") == cid
        return False  # deepgram: the socket closes

    def is_session_refusal(self, message: Json) -> bool:
        return self.is_busy(message) and (
            self.name != "native" or message.get("context_id") is None
        )

    def is_busy(self, message: Json) -> bool:
        if self.name == "native":
            return message.get("type") == "busy"
        if self.name == "elevenlabs":
            return message.get("error") == "busy" and message.get("code") == 1013
        if self.name == "cartesia":
            return (message.get("type") == "error" and message.get("status_code") == 429
                    and message.get("title") == "Busy")
        if self.name == "deepgram":
            warning = message.get("type") == "Warning" and message.get("code") == "BUSY"
            return message.get("err_code") == "BUSY" or warning
        if self.name == "jambonz":
            return message.get("type") == "error" and message.get("code") == "busy"
        return False

    def error_of(self, message: Json) -> tuple[str, str] | None:
        """(the protocol's error code or name, the message) when `message` is an error; else None."""
        if self.name == "native" and message.get("type") == "error":
            return message["code"], message["message"]
        if self.name == "elevenlabs" and "error" in message:
            return message["error"], message["message"]
        if self.name == "cartesia" and message.get("type") == "error":
            return str(message["status_code"]), message["message"]
        if self.name == "deepgram" and message.get("type") == "Warning":
            return message["code"], message["description"]
        if self.name == "deepgram" and message.get("type") == "Error":
            return message["err_code"], message["description"]
        if self.name == "jambonz" and message.get("type") == "error":
            return message["code"], message["error"]
        return None


# HTTP: (the body field that carries the text, the rest of a minimal body) and headers
HTTP_BODIES: dict[str, tuple[str, Json]] = {
    "openai": ("input", {"model": "tts-1", "voice": "alloy", "response_format": "pcm"}),
    "elevenlabs_http": ("text", {"model_id": "eleven_flash_v2_5"}),
    "cartesia_http": ("transcript", {"model_id": "sonic-2", "voice": {"mode": "id", "id": "v"},
                                     "output_format": {"container": "raw", "encoding": "pcm_s16le",
                                                       "sample_rate": 16_000}}),
    "deepgram_http": ("text", {}),
    "jambonz_http": ("text", {"type": "text", "language": "en-US", "voice": "v"}),
}
HTTP_HEADERS: dict[str, dict[str, str]] = {"jambonz_http": {"accept": "audio/l16;rate=16000"}}

DRIVERS = [
    Driver("native", "native", "/v1/stream", multi=True, greeting="session_started"),
    Driver("elevenlabs", "ElevenLabs stream-input", "/v1/text-to-speech/v1/stream-input", "output_format=pcm_16000"),
    Driver("elevenlabs", "ElevenLabs multi-stream-input", "/v1/text-to-speech/v1/multi-stream-input",
           "output_format=pcm_16000", multi=True),
    Driver("cartesia", "Cartesia", "/tts/websocket", multi=True),
    Driver("deepgram", "Deepgram", "/v1/speak", greeting="Metadata"),
    Driver("jambonz", "jambonz", "/v1/jambonz/stream", "sampleRate=16000", greeting="connect"),
    Driver("openai", "OpenAI HTTP", "/v1/audio/speech", http=True),
    Driver("elevenlabs_http", "ElevenLabs HTTP", "/v1/text-to-speech/v1/stream", "output_format=pcm_16000",
           http=True, bad_request_status=422),
    Driver("cartesia_http", "Cartesia HTTP", "/tts/bytes", http=True),
    Driver("deepgram_http", "Deepgram HTTP", "/v1/speak", "encoding=linear16&container=none&sample_rate=16000",
           http=True),
    Driver("jambonz_http", "jambonz HTTP", "/v1/jambonz/tts", http=True),
]
WEBSOCKET_DRIVERS = [d for d in DRIVERS if not d.http]


async def speak(driver: Driver, ws: FakeWebSocket, cid: str, text: str) -> list[Json]:
    """One whole turn on `ws`: the JSON messages up to its end (Deepgram: up to the close)."""
    for message in driver.turn(cid, text):
        ws.send_json(message)
    return await until_turn_done(driver, ws, cid)


async def until_turn_done(driver: Driver, ws: FakeWebSocket, cid: str) -> list[Json]:
    """The JSON messages up to the end of the turn on `ws` (Deepgram: up to the close). jambonz has no end of a
    turn (its context lives until `stop`, and it says nothing): there the flushed turn is over once every
    segment's audio arrived and the writer sent every frame of it."""
    if driver.name != "jambonz":
        return await until(driver, ws, lambda m: driver.is_turn_done(m, cid))
    hub = ws.app.state.hub
    async with asyncio.timeout(RECV_TIMEOUT_S):
        while True:
            if ws.closed.is_set():
                return ws.json_messages()
            streams = [ctx.stream for s in hub.sessions if isinstance(s, Session) and s.protocol_name == "jambonz"
                       for ctx in s.contexts.values()]
            if streams and all(isinstance(st, SpeechStream) and st.segment_count > 0 and st.all_segments_done
                               and st.frames_sent == st.frames_out for st in streams):
                return ws.json_messages()
            await asyncio.sleep(0.01)


async def until(driver: Driver, ws: FakeWebSocket, done: Any, timeout_s: float = RECV_TIMEOUT_S) -> list[Json]:
    """JSON messages until `done(message)` holds, or the server closes (then what came)."""
    got: list[Json] = []
    async with asyncio.timeout(timeout_s):
        while True:
            getter = asyncio.ensure_future(ws.received.get())
            closer = asyncio.ensure_future(ws.closed.wait())
            finished, _ = await asyncio.wait([getter, closer], return_when=asyncio.FIRST_COMPLETED)
            if getter in finished:
                closer.cancel()
                message = getter.result()
                if isinstance(message, bytes):
                    continue
                got.append(orjson.loads(message))
                if done(got[-1]):
                    return got
            else:
                getter.cancel()
                while not ws.received.empty():  # what came before the close
                    message = ws.received.get_nowait()
                    if isinstance(message, str):
                        got.append(orjson.loads(message))
                return got
