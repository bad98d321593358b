"""Every close the server decides reaches the wire as a close frame (RFC 6455 §7.1.7), on every WebSocket protocol.

uvicorn's wsproto path dropped the TCP connection without a frame for the closes wsproto decides while parsing
(1007 invalid UTF-8, 1002 a framing error: the client saw 1006), and closed with the rest of an oversize message
unread after its 1009 (a RST that can destroy the frame). `cli.ClosingWSProtocol` sends the frame, half-closes,
and reads the rest away. A raw socket reads what really comes off the wire: the close frame, then EOF (not a
RST); the `websockets` client (what the SDKs use) sees the code as `rcvd`.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from agent_server.settings import Settings

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import LiveServer, live_server

pytestmark = pytest.mark.timeout(120)

MAX_MESSAGE_BYTES = 16 * 1024
# the five WebSocket protocols (native, ElevenLabs, Cartesia, Deepgram, jambonz)
PATHS = ("/v1/stream", "/v1/text-to-speech/v1/stream-input", "/tts/websocket", "/v1/speak", "/v1/jambonz/stream")
READ_TIMEOUT_S = 5.0
PROMPT_S = 0.5  # the close frame and the FIN come at once (the linger is for the client's side)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("close"), max_message_bytes=MAX_MESSAGE_BYTES)
    with live_server(FakeEngine(), settings) as live:
        yield live


def frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bool = True) -> bytes:
    """One client frame, as RFC 6455 §5.2 lays it out (masked unless told)."""
    head = bytes([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if mask else 0
    n = len(payload)
    if n < 126:
        head += bytes([mask_bit | n])
    elif n < 1 << 16:
        head += bytes([mask_bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([mask_bit | 127]) + struct.pack("!Q", n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes((key * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")
    return head + key + masked


@dataclass(frozen=True)
class WireEnd:
    close_code: int | None  # the close frame's code; None: no close frame came
    reason: bytes
    end: str  # how the connection ended after it: "eof" | "reset" | "timeout"
    after_s: float  # from the last byte sent to the end


def handshake(port: int, path: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    status, _, rest = head.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 101"), status
    return sock, rest


def send_and_read_close(port: int, path: str, data: bytes) -> WireEnd:
    sock, received = handshake(port, path)
    with sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the server may close its reading side first; what it wrote is still to be read
        sent_s = time.monotonic()
        try:
            while chunk := sock.recv(65536):
                received += chunk
            end = "eof"
        except ConnectionResetError:
            end = "reset"
        except TimeoutError:
            end = "timeout"
        after_s = time.monotonic() - sent_s
    return WireEnd(*close_frame_in(received), end, after_s)


def close_frame_in(data: bytes) -> tuple[int | None, bytes]:
    """The close frame among the server's (unmasked) frames: its code and reason."""
    i = 0
    while i + 2 <= len(data):
        opcode, n = data[i] & 0x0F, data[i + 1] & 0x7F
        j = i + 2
        if n == 126:
            n, j = struct.unpack("!H", data[j : j + 2])[0], j + 2
        elif n == 127:
            n, j = struct.unpack("!Q", data[j : j + 8])[0], j + 8
        if opcode == 0x8:
            code = struct.unpack("!H", data[j : j + 2])[0] if n >= 2 else None
            return code, data[j + 2 : j + n]
        i = j + n
    return None, b""


BAD_INPUT = {
    "invalid UTF-8 in a text frame": (frame(0x1, b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xed\xa0\x80"), 1007),
    "a reserved opcode": (frame(0x3, b"hi"), 1002),
    "an unmasked client frame": (frame(0x1, b"hi", mask=False), 1002),
    "a close frame with code 999": (frame(0x8, struct.pack("!H", 999)), 1002),
    "a message over the limit": (frame(0x2, b"x" * (MAX_MESSAGE_BYTES + 1)), 1009),
    "a text message over the limit in two frames": (frame(0x1, b"x" * MAX_MESSAGE_BYTES, fin=False)
                                                    + frame(0x0, b"x"), 1009),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", BAD_INPUT, ids=str)
def test_the_close_the_server_decides_is_on_the_wire_then_eof(served: LiveServer, path: str, case: str) -> None:
    data, code = BAD_INPUT[case]
    end = send_and_read_close(served.port, path, data)
    assert (end.close_code, end.end) == (code, "eof"), end
    assert end.after_s < PROMPT_S, end


@pytest.mark.parametrize("path", PATHS[:2])
def test_an_oversize_message_still_in_flight_gets_its_1009_and_no_reset(served: LiveServer, path: str) -> None:
    """2 MB on its way when the server decides: the rest is read and dropped, so the kernel sends no RST over the
    close frame (uvicorn closed with it unread)."""
    end = send_and_read_close(served.port, path, frame(0x2, b"x" * 2_000_000))
    assert (end.close_code, end.end) == (1009, "eof"), end


def test_the_websockets_client_sees_1007_and_1009_as_received(served: LiveServer) -> None:
    """What an SDK sees: the server's close frame (`rcvd`), not an abnormal closure (1006)."""

    async def rcvd_code(path: str, payload: bytes | str) -> tuple[int | None, bool]:
        async with connect(f"ws://127.0.0.1:{served.port}{path}", max_size=None) as ws:
            if isinstance(payload, bytes):
                await ws.send(payload, text=True)  # sent as a text frame, unchecked
            else:
                await ws.send(payload)
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    async for _ in ws:
                        pass
            except ConnectionClosed:
                pass
            rcvd = ws.protocol.close_rcvd
            return (rcvd.code if rcvd else None), bool(ws.protocol.close_rcvd_then_sent)

    for path in PATHS:
        assert asyncio.run(rcvd_code(path, b"\xff\xfe bad")) == (1007, True), path
        assert asyncio.run(rcvd_code(path, "x" * (MAX_MESSAGE_BYTES + 1))) == (1009, True), path


def test_a_session_failed_by_bad_input_spares_the_others(served: LiveServer) -> None:
    """The failing connection's linger (reading the rest away) touches no other session."""

    async def scenario() -> tuple[int | None, int | None]:
        async with connect(served.ws_url) as bystander:
            await bystander.recv()  # session_started
            failed = send_and_read_close(served.port, "/v1/stream", BAD_INPUT["a reserved opcode"][0])
            await bystander.send("not json")  # answered with an error event: the session is still there
            await asyncio.wait_for(bystander.recv(), READ_TIMEOUT_S)
        return failed.close_code, bystander.close_code

    assert asyncio.run(scenario()) == (1002, 1000)
