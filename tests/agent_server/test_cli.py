"""The real `agent-server` process (a subprocess, fake engine), probed from outside the way an operator
or an attacker would: a loop of malformed requests leaks no session, credentials never reach the log
(uvicorn's own lines included), invalid UTF-8 cannot flood the log, each protocol's first audio is
counted, and the exit status says whether the drain was complete."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from agent_server.cli import EXIT_DRAIN_CUT

from tests.agent_server.live_server import REPO, cli_server
from tests.agent_server.native_client import NativeClient
from tests.services import free_port

pytestmark = pytest.mark.timeout(120)

KEY = "sk-cli-test-0123456789abcdef"
LEAK_LOOP = 500
# A query every WebSocket endpoint must survive: '¹'.isdigit() is True and int('¹') raises.
MALFORMED_QUERY = "inactivity_timeout=%C2%B9&sample_rate=%C2%B9&encoding=%FF&output_format=pcm_%C2%B9&%ZZ=%00&seed=x"
WS_PATHS = ("/v1/stream", "/v1/text-to-speech/v/stream-input", "/v1/text-to-speech/v/multi-stream-input",
            "/tts/websocket", "/v1/speak")


async def close_code_of(url: str) -> int | None:
    """Connect, read until the server closes (or 5 s pass: then close ourselves), return its code."""
    async with connect(url, open_timeout=10) as ws:
        try:
            async with asyncio.timeout(5):
                async for _ in ws:
                    pass
        except (ConnectionClosed, TimeoutError):
            pass
    return ws.close_code


UPGRADE = b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n" \
          b"Sec-WebSocket-Version: 13\r\n"


def handshake_status(port: int, target: str) -> int:
    """The status of a WebSocket handshake (101: upgraded; the connection is then dropped)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET " + target.encode() + b" HTTP/1.1\r\nHost: x\r\n" + UPGRADE + b"\r\n")
        head = b""
        while b"\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


def status_of(port: int) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5).json()
    return body


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_a_loop_of_malformed_queries_leaks_no_session(tmp_path: Path) -> None:
    """The leak found from outside: `?inactivity_timeout=¹` made ElevenLabs' greeting raise before the
    cleanup guard; a loop of them filled the server. 500 of them, then a malformed query on every
    WebSocket endpoint: every one gets a close frame and /v1/status is back at 0 sessions."""
    env = {"AGENT_SERVER_LOG_LEVEL": "warning", "AGENT_SERVER_MAX_SESSIONS": "64"}
    with cli_server(tmp_path, env) as (_, port, _):
        base = f"ws://127.0.0.1:{port}"

        async def scenario() -> tuple[list[int | None], dict[str, int | None]]:
            url = f"{base}/v1/text-to-speech/v/stream-input?inactivity_timeout=%C2%B9&output_format=pcm_16000"
            codes: list[int | None] = []
            for start in range(0, LEAK_LOOP, 25):
                codes += await asyncio.gather(*(close_code_of(url) for _ in range(min(25, LEAK_LOOP - start))))
            per_path = {path: await close_code_of(f"{base}{path}?{MALFORMED_QUERY}") for path in WS_PATHS}
            return codes, per_path

        codes, per_path = asyncio.run(scenario())
        assert codes == [1008] * LEAK_LOOP  # invalid_inactivity_timeout, in ElevenLabs' shape
        assert per_path["/v1/text-to-speech/v/stream-input"] == per_path["/v1/speak"] == 1008
        # the native and Cartesia endpoints take no query: they serve the session (we closed it)
        assert all(code is not None for code in per_path.values()), per_path
        assert status_of(port)["sessions"] == 0

        async def still_serves() -> str:
            client = await NativeClient.connect(f"{base}/v1/stream")
            await client.close()
            return str(client.hello["type"])

        assert asyncio.run(still_serves()) == "session_started"


def test_credentials_never_reach_the_log(tmp_path: Path) -> None:
    """An auth probe with keys and minted tokens in every place a client can put them; uvicorn's access
    and "WebSocket ... [accepted]" lines carry the query string: none of the secrets may be written."""
    env = {"AGENT_SERVER_API_KEYS": KEY, "AGENT_SERVER_LOG_LEVEL": "info"}
    with cli_server(tmp_path, env) as (_, port, log_path):
        http = f"http://127.0.0.1:{port}"
        token = httpx.post(f"{http}/v1/tokens", headers={"Authorization": f"Bearer {KEY}"}).json()["token"]
        secrets = [KEY, token, "wrong-key-12345678", token[:-4] + "AAAA"]
        for secret in secrets:
            for name in ("token", "api_key", "access_token", "xi_api_key", "api%5Fkey"):
                httpx.get(f"{http}/v1/status?{name}={secret}&x=1")
            httpx.get(f"{http}/v1/status", headers={"Authorization": f"Bearer {secret}"})
            httpx.get(f"{http}/v1/status", headers={"Authorization": f"Token {secret}"})
            httpx.post(f"{http}/v1/audio/speech?api_key={secret}", json={"model": "tts-1"})

        for secret in secrets:
            for path in WS_PATHS:
                status = handshake_status(port, f"{path}?token={secret}&output_format=pcm_16000")
                assert status == (101 if secret in (KEY, token) else 401)
    text = log_path.read_text()
    lines = log_lines(log_path)
    accepted = [line for line in lines if "[accepted]" in str(line.get("event"))]
    access = [line for line in lines if line.get("logger") == "uvicorn.access"]
    assert accepted and access, "the probe must produce uvicorn's own lines"
    assert any("token=[redacted]" in str(line.get("event")) for line in accepted)
    for secret in secrets:
        assert secret not in text, f"a credential is in the log: {secret[:6]}..."


def test_invalid_utf8_frames_make_one_log_line_per_period(tmp_path: Path) -> None:
    """Each frame that is not UTF-8 fails its connection (RFC 6455 8.1: a 1007 close frame, then FIN;
    the session records 1007); the log gets at most one `invalid_utf8` warning per period (with a count
    of the rest), never a traceback."""
    with cli_server(tmp_path, {"AGENT_SERVER_LOG_LEVEL": "info"}) as (_, port, log_path):

        def send_invalid_text_frame() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"GET /v1/stream HTTP/1.1\r\nHost: x\r\n" + UPGRADE + b"\r\n")
                head = b""
                while b"\r\n\r\n" not in head:
                    head += sock.recv(4096)
                payload = b"\xce\xba\xe1\xbd\xb9\xcf\x83\xce\xbc\xce\xb5\xed\xa0\x80"  # Autobahn 6.3.1
                mask = b"\x01\x02\x03\x04"
                masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                sock.sendall(bytes([0x81, 0x80 | len(payload)]) + mask + masked)
                while sock.recv(4096):  # (a greeting may come first)
                    pass
                return True  # the server closed the connection

        assert all(send_invalid_text_frame() for _ in range(20))
        assert status_of(port)["sessions"] == 0
    lines = log_lines(log_path)
    closed = [line for line in lines if line.get("event") == "session_closed"]
    assert len(closed) == 20 and {line["code"] for line in closed} == {1007}
    utf8 = [line for line in lines if line.get("event") == "invalid_utf8"]
    assert len(utf8) == 1 and utf8[0]["level"] == "warning"
    assert not [line for line in lines if line.get("level") == "error" or "exception" in line]


def test_each_protocols_first_audio_is_counted(tmp_path: Path) -> None:
    """/metrics after one turn on each protocol: each protocol's time-to-first-audio count is 1."""
    with cli_server(tmp_path, {"AGENT_SERVER_LOG_LEVEL": "warning"}) as (_, port, _):
        base = f"ws://127.0.0.1:{port}"

        async def turns() -> None:
            native = await NativeClient.connect(f"{base}/v1/stream")
            log = await native.open("a", text="Hello there. ")
            await native.end("a")
            await asyncio.wait_for(log.finished.wait(), 10)
            await native.close()
            async with connect(f"{base}/v1/text-to-speech/v/stream-input?output_format=pcm_16000") as ws:
                for text in (" ", "Hello there. ", ""):
                    await ws.send(json.dumps({"text": text}))
                async for message in ws:
                    if json.loads(message).get("isFinal"):
                        break
            async with connect(f"{base}/v1/text-to-speech/v/multi-stream-input?output_format=pcm_16000") as ws:
                await ws.send(json.dumps({"text": "Hello there. ", "context_id": "c", "flush": True}))
                await ws.send(json.dumps({"context_id": "c", "close_context": True}))
                async for message in ws:
                    if json.loads(message).get("isFinal"):
                        break
            async with connect(f"{base}/tts/websocket") as ws:
                await ws.send(json.dumps({"context_id": "c", "transcript": "Hello there. ", "continue": False}))
                async for message in ws:
                    if json.loads(message).get("type") == "done":
                        break
            async with connect(f"{base}/v1/speak") as ws:
                await ws.send(json.dumps({"type": "Speak", "text": "Hello there. "}))
                await ws.send(json.dumps({"type": "Close"}))
                async for _ in ws:
                    pass

        asyncio.run(turns())
        response = httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech",
                              json={"model": "tts-1", "voice": "alloy", "input": "Hello there.",
                                    "response_format": "pcm"})
        assert response.status_code == 200 and response.content
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    counts = {}
    for line in scrape.splitlines():
        if line.startswith("tts_time_to_first_audio_seconds_count{"):
            protocol = line.split('protocol="', 1)[1].split('"', 1)[0]
            counts[protocol] = float(line.rsplit(" ", 1)[1])
    # ElevenLabs' two endpoints are one protocol label
    assert counts == {"native": 1.0, "elevenlabs": 2.0, "cartesia": 1.0, "deepgram": 1.0, "openai": 1.0}, counts


def test_exit_status_says_whether_the_drain_was_complete(tmp_path: Path) -> None:
    """SIGTERM with nothing in flight: exit 0 (uvicorn would re-raise the signal: 143). SIGTERM while a
    turn outlasts the grace period: exit EXIT_DRAIN_CUT."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with cli_server(tmp_path / "a", {}) as (proc, _, _):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    env = {"FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 1.0})}
    with cli_server(tmp_path / "b", env, "--shutdown-grace-s", "0.5") as (proc, port, log_path):

        async def speak_then_signal() -> str | None:
            client = await NativeClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
            try:
                log = await client.open("long", text="A long answer that takes many seconds to speak. " * 4)
                await client.end("long")
                while not log.frames:
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(log.finished.wait(), 10)
                return None if log.done is None else str(log.done["reason"])
            finally:
                await client.close()  # left to the GC, its socket warns in whichever test runs then

        reason = asyncio.run(speak_then_signal())
        assert proc.wait(20) == EXIT_DRAIN_CUT
    assert reason == "shutdown"
    assert any(line.get("event") == "drain_deadline" for line in log_lines(log_path))


def test_a_second_sigterm_skips_the_wait(tmp_path: Path) -> None:
    """The drain waits up to --shutdown-grace-s for speech to end; a second SIGTERM (not only Ctrl-C twice)
    cuts it short: the process exits at once, the turn ended as shutdown."""
    env = {"FAKE_ENGINE_OPTIONS": json.dumps({"realtime_factor": 1.0})}
    with cli_server(tmp_path, env, "--shutdown-grace-s", "60") as (proc, port, _):

        async def speak_then_signal_twice() -> tuple[str | None, float]:
            client = await NativeClient.connect(f"ws://127.0.0.1:{port}/v1/stream")
            try:
                log = await client.open("long", text="A long answer that takes many seconds to speak. " * 8)
                await client.end("long")
                while not log.frames:
                    await asyncio.sleep(0.01)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                started_s = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(log.finished.wait(), 10)
                return (None if log.done is None else str(log.done["reason"])), time.monotonic() - started_s
            finally:
                await client.close()

        reason, waited_s = asyncio.run(speak_then_signal_twice())
        assert proc.wait(20) == EXIT_DRAIN_CUT
    assert reason == "shutdown" and waited_s < 10


def refused_start(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run `agent-server` with settings it must refuse: (exit status, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "AGENT_SERVER_DATA_DIR": str(tmp_path),
           "AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.fake_engine:make_engine"}
    done = subprocess.run([sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", "--port",
                           str(free_port()), *args],
                          env=env, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stderr


def test_settings_no_restart_can_fix_are_refused_before_the_port_opens(tmp_path: Path) -> None:
    """Exit 2 with the reason, not a traceback, nor the engine-failed status (70) a supervisor restarts on."""
    keys = tmp_path / "keys"
    keys.write_text("sk-file-key-0001 # the billing team's\nnot a key\n")
    cases: list[tuple[tuple[str, ...], str]] = [
        (("--shutdown-grace-s", "-1"), "--shutdown-grace-s must be >= 0"),  # the flag's name, not the field's
        (("--api-keys-file", str(keys)), f"{keys}, line 2: an API key must be"),
        (("--metrics-port", "70000"), "--metrics-port must be in 0..65535"),
        (("--tls-cert", str(tmp_path / "none.pem")), "--tls-cert and --tls-key go together"),
        (("--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(keys)), f"--tls-cert {tmp_path / 'none.pem'}:"
                                                                              " No such file"),
        (("--tls-cert", str(keys), "--tls-key", str(keys)), "not a PEM certificate and its private key"),
    ]
    if not torch.cuda.is_available():
        cases += [(("--cuda-graphs", "on"), "cuda_graphs='on' needs a CUDA device"),
                  (("--device", "cuda"), "torch finds no CUDA device")]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for flag in ("--port", "--metrics-port", "--grpc-port", "--agent-check-port"):
            cases.append(((flag, str(taken.getsockname()[1])), flag))
        for args, reason in cases:
            status, stderr = refused_start(tmp_path, *args)
            assert status == 2 and reason in stderr and "Traceback" not in stderr, (args, status, stderr[-2000:])


def test_the_metrics_port_listens_on_its_own_interface(tmp_path: Path) -> None:
    """`--metrics-host`: the unauthenticated metrics listener on a private interface while the API is on another
    (here 127.0.0.2 and 127.0.0.1, two loopback addresses)."""
    metrics_port = free_port()
    with cli_server(tmp_path, {}, "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.2") as (_, port, _):
        deadline_s = time.monotonic() + 10
        while True:
            try:
                scraped = httpx.get(f"http://127.0.0.2:{metrics_port}/metrics", timeout=1)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline_s
                time.sleep(0.1)
        assert scraped.status_code == 200 and "tts_sessions_active" in scraped.text
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
