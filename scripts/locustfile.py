"""Locust load test of the native WebSocket protocol (docs/protocol.md), for those who load-test with Locust.

`scripts/loadtest.py` is the project's own load test (it starts a server, checks every frame, writes a
report); this file drives a running server from Locust's UI or headless runner instead. Each simulated
user keeps one WebSocket session and, until it has spoken MAX_TURNS_PER_USER turns, opens a context,
streams a reply in 1-8 character pieces, ends it and waits for `context_done`. Locust records:

- `WS ttfa`: first text piece sent -> first audio frame received (ms);
- `WS turn`: first text piece sent -> context_done (ms);
- failures: `busy`, `error` events, a close, a context that ends other than `completed`, lost frames.

Bounded and local by construction: the host must be loopback (127.0.0.1, localhost, ::1), a headless run
must give --run-time (at most MAX_RUN_TIME_S) and at most MAX_USERS users.

    pip install -e '.[locust]'
    agent-server --engine-factory tests.agent_server.fake_engine:make_engine &
    locust -f scripts/locustfile.py --headless -u 50 -r 10 --run-time 60s --host ws://127.0.0.1:8000
    # with auth on: AGENT_SERVER_API_KEY=... locust -f scripts/locustfile.py ...
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import time
from typing import Any
from urllib.parse import urlparse

from locust import User, between, events, task
from locust.exception import StopUser
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
MAX_USERS = 2000
MAX_RUN_TIME_S = 600
MAX_TURNS_PER_USER = 100
TURN_TIMEOUT_S = 60.0
CHARS_PER_S = 400.0
FRAME_HEADER = struct.Struct("<BBHII")
REPLIES = [
    "Sure, I can help with that. Your flight to Lisbon leaves at nine fifteen tomorrow morning, from gate twelve.",
    "Okay, let me check. The store opens at ten and closes at six on weekdays.",
    "Hello! I found three restaurants nearby. The closest one is Italian, about five minutes away.",
    "Right, your balance is two hundred dollars. Anything else I can do for you today?",
]


@events.test_start.add_listener
def _check_bounds(environment: Any, **_: Any) -> None:
    host = environment.host or ""
    if urlparse(host).hostname not in LOOPBACK_HOSTS:
        raise SystemExit(f"--host must be a loopback ws:// URL (got {host!r}): load runs stay on this machine")
    options = environment.parsed_options
    if options is not None and options.headless:
        if not options.run_time or options.run_time > MAX_RUN_TIME_S:
            raise SystemExit(f"give --run-time (at most {MAX_RUN_TIME_S} s)")
        if options.num_users is not None and options.num_users > MAX_USERS:
            raise SystemExit(f"at most {MAX_USERS} users")


class GreenWebSocket:
    """A blocking WebSocket client on websockets' sans-I/O protocol and a plain socket, which gevent
    (Locust) makes cooperative; websockets' own sync client runs a thread per connection instead."""

    def __init__(self, url: str, headers: dict[str, str], timeout_s: float = 10.0) -> None:
        uri = parse_uri(url)
        self.sock = socket.create_connection((uri.host, uri.port), timeout=timeout_s)
        self.protocol = ClientProtocol(uri, max_size=None)
        request = self.protocol.connect()
        for name, value in headers.items():
            request.headers[name] = value
        self.protocol.send_request(request)
        self._flush()
        self._messages: list[str | bytes] = []
        while self.protocol.state is State.CONNECTING:
            self._read(timeout_s)
        if self.protocol.handshake_exc is not None:
            raise self.protocol.handshake_exc

    def send(self, text: str) -> None:
        self.protocol.send_text(text.encode())
        self._flush()

    def recv(self, timeout_s: float) -> str | bytes:
        while not self._messages:
            if self.protocol.state is State.CLOSED:
                raise self.protocol.close_exc
            self._read(timeout_s)
        return self._messages.pop(0)

    def close(self) -> None:
        if self.protocol.state is State.OPEN:
            self.protocol.send_close(1000)
            self._flush()
        self.sock.close()

    def _read(self, timeout_s: float) -> None:
        self.sock.settimeout(timeout_s)
        data = self.sock.recv(65536)
        if data:
            self.protocol.receive_data(data)
        else:
            self.protocol.receive_eof()
        for event in self.protocol.events_received():
            if isinstance(event, Frame) and event.opcode is Opcode.TEXT:  # the server never fragments
                self._messages.append(bytes(event.data).decode())
            elif isinstance(event, Frame) and event.opcode is Opcode.BINARY:
                self._messages.append(bytes(event.data))
            elif isinstance(event, Response):
                pass
        self._flush()  # pongs, close replies

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            if data:
                self.sock.sendall(data)
            else:
                self.sock.shutdown(socket.SHUT_WR)


def llm_pieces(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        pieces.append(text[i : i + n])
        i += n
    return pieces


class NativeSpeaker(User):
    """One voice-agent session: turn after turn on one socket."""

    wait_time = between(0.5, 2.0)  # the user speaks between the agent's turns
    host = "ws://127.0.0.1:8000"

    def on_start(self) -> None:
        if urlparse(self.host).hostname not in LOOPBACK_HOSTS:
            raise StopUser()
        self.rng = random.Random()
        self.turns = 0
        headers = {}
        key = os.environ.get("AGENT_SERVER_API_KEY")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        try:
            self.ws = GreenWebSocket(self.host.rstrip("/") + "/v1/stream", headers)
            hello = json.loads(self.ws.recv(10.0))
        except (OSError, InvalidHandshake, ConnectionClosed) as exc:
            self._fail("session", 0.0, f"connect: {exc!r}")
            raise StopUser() from None
        if hello.get("type") != "session_started":
            self._fail("session", 0.0, f"refused: {hello}")
            raise StopUser()

    def on_stop(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()

    @task
    def speak(self) -> None:
        if self.turns >= MAX_TURNS_PER_USER:
            raise StopUser()
        self.turns += 1
        cid = f"t{self.turns}"
        text = self.rng.choice(REPLIES)
        started_s = time.monotonic()
        try:
            self._send({"type": "open", "context_id": cid})
            for piece in llm_pieces(text, self.rng):
                self._send({"type": "text", "context_id": cid, "text": piece})
                time.sleep(len(piece) / CHARS_PER_S)
            self._send({"type": "end", "context_id": cid})
            self._read_turn(cid, started_s)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            self._fail("turn", (time.monotonic() - started_s) * 1000, f"connection: {exc!r}")
            raise StopUser() from None

    def _read_turn(self, cid: str, started_s: float) -> None:
        stream_id, frames, first_frame_s = None, 0, None
        deadline_s = started_s + TURN_TIMEOUT_S
        while True:
            message = self.ws.recv(max(0.1, deadline_s - time.monotonic()))
            if isinstance(message, bytes):
                _, _, _, sid, seq = FRAME_HEADER.unpack_from(message)
                if sid == stream_id:
                    if seq != frames:
                        self._fail("turn", 0.0, f"frame seq {seq}, expected {frames}")
                    frames += 1
                    if first_frame_s is None:
                        first_frame_s = time.monotonic()
                        self._ok("ttfa", (first_frame_s - started_s) * 1000, len(message))
                continue
            event = json.loads(message)
            if event.get("context_id") != cid:
                continue
            kind = event["type"]
            if kind == "context_started":
                stream_id = event["stream_id"]
            elif kind in ("busy", "error"):
                self._fail("turn", (time.monotonic() - started_s) * 1000, f"{kind}: {event}")
            elif kind == "context_done":
                elapsed_ms = (time.monotonic() - started_s) * 1000
                if event["reason"] == "completed" and event["frames"] == frames:
                    self._ok("turn", elapsed_ms, frames)
                elif event["reason"] != "busy":
                    self._fail("turn", elapsed_ms, f"ended {event['reason']} with {frames}/{event['frames']} frames")
                return

    def _send(self, obj: dict[str, Any]) -> None:
        self.ws.send(json.dumps(obj))

    def _ok(self, name: str, ms: float, length: int) -> None:
        self.environment.events.request.fire(request_type="WS", name=name, response_time=ms,
                                             response_length=length, exception=None, context={})

    def _fail(self, name: str, ms: float, why: str) -> None:
        self.environment.events.request.fire(request_type="WS", name=name, response_time=ms,
                                             response_length=0, exception=RuntimeError(why), context={})
