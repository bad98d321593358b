"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, for tests and the load test."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from agent_server.app import create_app
from agent_server.cli import GracefulServer, build_server
from agent_server.core.hub import Hub
from agent_server.settings import Settings
from synth.api import EngineLike

REPO = Path(__file__).resolve().parents[2]

STARTUP_TIMEOUT_S = 15.0


@dataclass
class LiveServer:
    server: GracefulServer
    thread: threading.Thread
    port: int
    app: Starlette

    tls: bool = False

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}/v1/stream"

    @property
    def hub(self) -> Hub:
        hub: Hub = self.app.state.hub
        return hub

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(self.http_url + "/readyz", timeout=1.0, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline_s:
                raise TimeoutError("server not ready")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True  # what SIGTERM does
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "server did not stop"


def make_test_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem in `directory`), made with the openssl command."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


@contextlib.contextmanager
def live_server(
    engine: EngineLike, settings: Settings, *, wait_ready: bool = True, extra_routes: Sequence[BaseRoute] = (),
    **app_options: Any,
) -> Iterator[LiveServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = settings.replace(host="127.0.0.1", port=port)
    app = create_app(engine, settings, **app_options)
    served = {getattr(route, "path", None) for route in app.router.routes}
    app.router.routes.extend(r for r in extra_routes if getattr(r, "path", None) not in served)
    server = build_server(app, settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    live = LiveServer(server, thread, port, app, tls=settings.tls_certfile is not None)
    try:
        deadline_s = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline_s:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        if wait_ready:
            live.wait_ready()
        yield live
    finally:
        if thread.is_alive():
            live.stop()
        sock.close()


@contextmanager
def cli_server(tmp_path: Path, env: dict[str, str], *args: str) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """The real `agent-server` command in a subprocess, on a free port, with a fake engine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "AGENT_SERVER_ENGINE_FACTORY": "tests.agent_server.fake_engine:make_engine",
        "AGENT_SERVER_DATA_DIR": str(tmp_path),
        "PORT": str(port),
        **env,
    }
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "agent_server.cli", "--host", "127.0.0.1", *args],
                                env=full_env, stderr=log_file, stdout=subprocess.DEVNULL)
    try:
        deadline_s = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline_s
            time.sleep(0.05)
        yield proc, port, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
