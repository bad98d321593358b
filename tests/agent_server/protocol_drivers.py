"""One client driver per protocol, for the tests that run the same scenario over every protocol
(test_behaviour.py, test_session.py): how to speak a turn, and how that protocol says busy, error,
done. They drive the app in-process (tests/agent_server/fake_asgi.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.applications import Starlette

from tests.agent_server.fake_asgi import RECV_TIMEOUT_S, FakeHttpRequest, FakeWebSocket

Json = dict[str, Any]


@dataclass(frozen=True)
class Driver:
    name: str  # the protocol's label in metrics and logs
    path: str
    query: str = ""
    http: bool = False
    multi: bool = False  # several contexts per session
    greeting: str | None = None  # the "type" of the first message of a session

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

    def request(self, app: Starlette, text: str | None, headers: dict[str, str] | None = None) -> FakeHttpRequest:
        body: Json = {"model": "tts-1", "voice": "alloy", "response_format": "pcm"}
        if text is not None:
            body["input"] = text
        request = FakeHttpRequest(app, self.path, body, headers)
        request.start()
        return request

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
        return None


DRIVERS = [
    Driver("native", "/v1/stream", multi=True, greeting="session_started"),
    Driver("elevenlabs", "/v1/text-to-speech/v1/stream-input", "output_format=pcm_16000"),
    Driver("elevenlabs", "/v1/text-to-speech/v1/multi-stream-input", "output_format=pcm_16000", multi=True),
    Driver("cartesia", "/tts/websocket", multi=True),
    Driver("deepgram", "/v1/speak", greeting="Metadata"),
    Driver("openai", "/v1/audio/speech", http=True),
]
WEBSOCKET_DRIVERS = [d for d in DRIVERS if not d.http]


async def speak(driver: Driver, ws: FakeWebSocket, cid: str, text: str) -> list[Json]:
    """One whole turn on `ws`: the JSON messages up to its end (Deepgram: up to the close)."""
    for message in driver.turn(cid, text):
        ws.send_json(message)
    return await until(driver, ws, lambda m: driver.is_turn_done(m, cid))


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
