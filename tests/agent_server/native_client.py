"""A small asyncio client of the native protocol (docs/protocol.md), for the tests and the load test.

It demultiplexes one socket into per-context logs: events, audio frames (with their receive time), and
checks nothing itself: callers assert on what it recorded.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from agent_server.protocols import native_wire as wire


@dataclass
class ContextLog:
    context_id: str
    started: dict[str, Any] | None = None
    segments_started: list[dict[str, Any]] = field(default_factory=list)
    segments_done: list[dict[str, Any]] = field(default_factory=list)
    frames: list[tuple[wire.FrameHeader, bytes, float]] = field(default_factory=list)  # header, payload, recv_s
    done: dict[str, Any] | None = None
    busy: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    first_text_sent_s: float | None = None
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    order: list[str] = field(default_factory=list)  # "event:<type>" and "frame" in arrival order

    @property
    def audio(self) -> bytes:
        return b"".join(payload for _, payload, _ in self.frames)

    @property
    def first_frame_recv_s(self) -> float | None:
        return self.frames[0][2] if self.frames else None


class NativeClient:
    def __init__(self, ws: ClientConnection, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.hello = hello
        self.contexts: dict[str, ContextLog] = {}
        self.by_stream: dict[int, ContextLog] = {}
        self.errors: asyncio.Queue[dict[str, Any]] = asyncio.Queue()  # errors without a known context
        self.busy: list[dict[str, Any]] = []
        self.stray_frames = 0  # frames of a stream id never announced
        self.closed: ConnectionClosed | None = None
        self.close_code: int | None = None  # the code the server's close frame carried (None: no close frame)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, **kwargs: Any) -> NativeClient:
        ws = await connect(url, max_size=None, compression=None, **kwargs)
        try:
            hello = orjson.loads(await ws.recv())
        except BaseException:
            await ws.close()  # a server that closes before its hello must not leave our socket to the GC
            raise
        return cls(ws, hello)

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def wait_closed(self) -> int | None:
        """Wait for the server to close; its close code (None: the connection dropped without one)."""
        await asyncio.gather(self._reader, return_exceptions=True)
        return self.close_code

    # ---- messages --------------------------------------------------------------------------------

    async def send(self, obj: dict[str, Any]) -> None:
        await self.ws.send(orjson.dumps(obj).decode())

    async def open(self, context_id: str, **fields: Any) -> ContextLog:
        log = self.contexts[context_id] = ContextLog(context_id)
        if fields.get("text"):
            log.first_text_sent_s = time.monotonic()
        await self.send({"type": "open", "context_id": context_id, **fields})
        return log

    async def text(self, context_id: str, text: str) -> None:
        log = self.contexts[context_id]
        if log.first_text_sent_s is None:
            log.first_text_sent_s = time.monotonic()
        await self.send({"type": "text", "context_id": context_id, "text": text})

    async def end(self, context_id: str) -> None:
        await self.send({"type": "end", "context_id": context_id})

    async def flush(self, context_id: str) -> None:
        await self.send({"type": "flush", "context_id": context_id})

    async def cancel(self, context_id: str) -> None:
        await self.send({"type": "cancel", "context_id": context_id})

    async def stream_text(
        self, context_id: str, text: str, *, chars_per_s: float = 400.0, seed: int = 0, end: bool = True
    ) -> None:
        """Push `text` the way an LLM streams it: pieces of 1-8 characters at `chars_per_s`."""
        for piece in llm_pieces(text, seed):
            await self.text(context_id, piece)
            await asyncio.sleep(len(piece) / chars_per_s)
        if end:
            await self.end(context_id)

    # ---- the reader ------------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                now_s = time.monotonic()
                if isinstance(raw, bytes):
                    header, payload = wire.decode_frame(raw)
                    log = self.by_stream.get(header.stream_id)
                    if log is None:
                        self.stray_frames += 1
                    else:
                        log.frames.append((header, payload, now_s))
                        log.order.append("frame")
                    continue
                self._on_event(orjson.loads(raw))
        except ConnectionClosed as exc:
            self.closed = exc
        finally:
            rcvd = self.ws.protocol.close_rcvd
            self.close_code = rcvd.code if rcvd is not None else None
            for log in self.contexts.values():
                log.finished.set()

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        log = self.contexts.get(event.get("context_id") or "")
        if log is None:
            if kind == "error":
                self.errors.put_nowait(event)
            elif kind == "busy":
                self.busy.append(event)
            return
        log.order.append(f"event:{kind}")
        if kind == "context_started":
            log.started = event
            self.by_stream[event["stream_id"]] = log
        elif kind == "segment_started":
            log.segments_started.append(event)
        elif kind == "segment_done":
            log.segments_done.append(event)
        elif kind == "context_done":
            log.done = event
            log.finished.set()
        elif kind == "busy":
            log.busy = event
            self.busy.append(event)
        elif kind == "error":
            log.errors.append(event)
            self.errors.put_nowait(event)


def llm_pieces(text: str, seed: int = 0) -> list[str]:
    """`text` cut into 1-8 character pieces, as an LLM's tokens arrive."""
    rng = random.Random(seed)
    pieces = []
    i = 0
    while i < len(text):
        n = rng.randint(1, 8)
        pieces.append(text[i : i + n])
        i += n
    return pieces
