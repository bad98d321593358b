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

`JobSubmitter` (issue 36, docs/jobs.md) mixes jobs with the live sessions, one job user for every
LOCUST_JOB_RATIO (default 4) speakers: it POSTs a 2,000-5,000 character job, polls its status with backoff,
downloads the finished audio with a Range request and checks its Content-Length and Content-Range. Locust records
`HTTP job submit`, `HTTP job done` (submission -> done, ms) and `HTTP job range`; a 429 (the key's job quota) is a
failure named so. Live sessions only: `locust -f scripts/locustfile.py NativeSpeaker ...`.
"""

from __future__ import annotations

import http.client
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

    weight = int(os.environ.get("LOCUST_JOB_RATIO", "4"))

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


JOB_SENTENCES = [
    "Here is the summary of your call with the support team earlier today.",
    "The technician will visit on Thursday between nine and noon, and will call you thirty minutes before.",
    "Your reference number is four seven two, and the warranty covers the replacement part.",
    "If anything changes, reply to the text message and we will find another time that suits you.",
]
JOB_TIMEOUT_S = 600.0
RANGE_BYTES = 4096


class JobSubmitter(User):
    """A client of the jobs API: submit a long text, poll with backoff, fetch part of the finished file."""

    weight = 1
    wait_time = between(1.0, 5.0)
    host = "ws://127.0.0.1:8000"

    def on_start(self) -> None:
        parsed = urlparse(self.host)
        if parsed.hostname not in LOOPBACK_HOSTS:
            raise StopUser()
        self.address = (parsed.hostname, parsed.port or 8000)
        self.rng = random.Random()
        self.headers = {"Content-Type": "application/json"}
        key = os.environ.get("AGENT_SERVER_API_KEY")
        if key:
            self.headers["Authorization"] = f"Bearer {key}"

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        connection = http.client.HTTPConnection(*self.address, timeout=60)
        try:
            connection.request(method, path, body=body, headers={**self.headers, **(headers or {})})
            response = connection.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            connection.close()

    @task
    def one_job(self) -> None:
        target = self.rng.randint(2000, 5000)
        sentences: list[str] = []
        while sum(len(x) + 1 for x in sentences) < target:
            sentences.append(self.rng.choice(JOB_SENTENCES))
        body = json.dumps({"text": " ".join(sentences), "output_format": "mp3"}).encode()
        started_s = time.monotonic()
        try:
            status, _, answer = self._request("POST", "/v1/jobs", body)
            ms = (time.monotonic() - started_s) * 1000
            if status != 202:
                code = json.loads(answer).get("error", {}).get("code", "") if answer else ""
                self._fire("job submit", ms, 0, f"{status} {code}")
                return
            self._fire("job submit", ms, len(answer))
            job_id = json.loads(answer)["id"]
            delay_s = 0.5
            while True:
                time.sleep(delay_s)
                delay_s = min(delay_s * 1.5, 10.0)
                status, _, answer = self._request("GET", f"/v1/jobs/{job_id}")
                seen = json.loads(answer) if status == 200 else {"status": f"http {status}"}
                if seen["status"] == "done":
                    self._fire("job done", (time.monotonic() - started_s) * 1000, len(answer))
                    break
                if seen["status"] not in ("queued", "running") or time.monotonic() - started_s > JOB_TIMEOUT_S:
                    self._fire("job done", (time.monotonic() - started_s) * 1000, 0, f"ended {seen['status']}")
                    return
            range_s = time.monotonic()
            status, headers, audio = self._request("GET", f"/v1/jobs/{job_id}/audio",
                                                   headers={"Range": f"bytes=0-{RANGE_BYTES - 1}"})
            ms = (time.monotonic() - range_s) * 1000
            total = int(headers.get("content-range", "/0").rsplit("/", 1)[1] or 0)
            expected = min(RANGE_BYTES, total)
            if status != 206 or int(headers.get("content-length", -1)) != len(audio) or len(audio) != expected:
                self._fire("job range", ms, 0, f"{status}, {len(audio)} bytes, headers {headers}")
            else:
                self._fire("job range", ms, len(audio))
        except (OSError, ValueError, KeyError) as exc:
            self._fire("job", (time.monotonic() - started_s) * 1000, 0, repr(exc))

    def _fire(self, name: str, ms: float, length: int, why: str = "") -> None:
        self.environment.events.request.fire(request_type="HTTP", name=name, response_time=ms, response_length=length,
                                             exception=RuntimeError(why) if why else None, context={})
