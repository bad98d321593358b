"""A real HTTP/1.1 receiver for webhooks on 127.0.0.1: records each request, answers from a script."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """An HTTP/1.1 server on 127.0.0.1 answering each request with the next (status, headers) of `answers`
    (the last one repeats); with `hold`, only once it is set (a receiver that hangs)."""

    answers: list[tuple[int, dict[str, str]]]
    received: list[Received] = field(default_factory=list)
    port: int = 0
    server: asyncio.Server | None = None
    hold: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            if ":" in line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.received.append(Received(head[0].split(" ")[1], headers, body))
        if self.hold is not None:
            await self.hold.wait()
        status, extra = self.answers[min(len(self.received), len(self.answers)) - 1]
        lines = [f"HTTP/1.1 {status} X", "Content-Length: 2", "Connection: close",
                 *(f"{k}: {v}" for k, v in extra.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\nok").encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()
