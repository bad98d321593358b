"""Real Redis and HAProxy on 127.0.0.1 for the tests (Debian's redis-server and haproxy, installed by
scripts/ci_scale_deps.sh): started on free ports in a temporary directory, stopped (and waited for) after.

Without the programs a test skips, except under CI (CI=true), where it fails: a broken install must not pass.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REDIS_SERVER = os.environ.get("REDIS_SERVER", "redis-server")
HAPROXY = os.environ.get("HAPROXY", "haproxy")
DEPLOY_HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
START_TIMEOUT_S = 10.0


def require(program: str, installer: str = "scripts/ci_scale_deps.sh") -> str:
    """The program's path; skip (fail under CI) when it is not installed (`installer` is the script that does)."""
    path = shutil.which(program) or (f"/usr/sbin/{program}" if Path(f"/usr/sbin/{program}").exists() else None)
    if path is None:
        message = f"{program} not found ({installer} installs it from Debian)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline_s = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline_s:
            raise TimeoutError(f"nothing listens on {port}")
        time.sleep(0.02)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Loopback:
    """A server of ours on 127.0.0.1 (`port`): its HTTP and native WebSocket URLs."""

    port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"


@dataclass
class RedisServer:
    """redis-server with an append-only file (so a restart keeps the data, as deploy/ runs it)."""

    directory: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        program = require(REDIS_SERVER)
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [program, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--appendonly", "yes", "--save", "", "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
                "--daemonize", "no", "--loglevel", "warning"]
        with open(self.directory / "redis.log", "ab") as log_file:
            self.proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
        wait_port(self.port, self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)  # SIGTERM: redis flushes the append-only file and exits
            self.proc = None


@contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    server = RedisServer(directory)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Backend:
    name: str
    port: int
    agent_port: int


@dataclass
class HAProxy(Loopback):
    proc: subprocess.Popen[bytes]
    port: int
    stats_socket: Path

    def command(self, line: str) -> str:
        """One command on HAProxy's admin socket (`show servers state tts`, ...)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect(str(self.stats_socket))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, dict[str, str]]:
        """Per backend server: its `show stat` columns (status, weight, check_status, agent_status, ...)."""
        rows = self.command("show stat").splitlines()
        header = rows[0].lstrip("# ").split(",")
        out: dict[str, dict[str, str]] = {}
        for row in rows[1:]:
            values = dict(zip(header, row.split(","), strict=False))  # (a trailing empty column)
            if values.get("pxname") == "tts" and values.get("svname") not in ("FRONTEND", "BACKEND", None):
                out[values["svname"]] = values
        return out


def haproxy_config(backends: Sequence[Backend], port: int, stats_socket: Path,
                   template: Path = DEPLOY_HAPROXY_CFG) -> str:
    """deploy/haproxy/haproxy.cfg made to run here: the same defaults, checks and balancing, with loopback
    servers in place of its DNS `server-template` and the bind and admin socket moved to free places."""
    text = template.read_text()
    text = re.sub(r"^\s*bind\s+\S+", f"    bind 127.0.0.1:{port}", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^\s*stats socket\s+\S+", f"    stats socket {stats_socket}", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^\s*server-template\s.*$", "", text, flags=re.MULTILINE)
    text = re.sub(r"^resolvers\s.*?(?=^\S|\Z)", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^(\s*default-server\s.*?)resolvers\s+\S+", r"\1", text, flags=re.MULTILINE)
    text = re.sub(r"^(\s*default-server\s.*?)init-addr\s+\S+", r"\1", text, flags=re.MULTILINE)
    servers = "".join(f"    server {b.name} 127.0.0.1:{b.port} agent-port {b.agent_port}\n" for b in backends)
    return _append_servers(text, servers)


def _append_servers(text: str, servers: str) -> str:
    """Insert the server lines at the end of the `backend tts` section."""
    match = re.search(r"^backend tts\n(?:^[ \t].*\n|^\s*\n)*", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError("the template has no `backend tts` section")
    return text[: match.end()].rstrip("\n") + "\n" + servers + text[match.end():]


@contextmanager
def haproxy(directory: Path, backends: Sequence[Backend]) -> Iterator[HAProxy]:
    program = require(HAPROXY)
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stats_socket = directory / "haproxy.sock"
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_config(backends, port, stats_socket))
    check = subprocess.run([program, "-c", "-f", str(config)], check=False, capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"haproxy -c refused the config:\n{check.stdout}{check.stderr}\n{config.read_text()}")
    with open(directory / "haproxy.log", "ab") as log_file:
        proc = subprocess.Popen([program, "-db", "-f", str(config)], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        yield HAProxy(proc, port, stats_socket)
    finally:
        stop_process(proc, signal.SIGUSR1)  # soft stop
