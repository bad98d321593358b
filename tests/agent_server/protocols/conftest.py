"""A real uvicorn server on 127.0.0.1 with the compat routes (TLS with a certificate made here; the Riva
gRPC service on a port of its own), the FakeEngine behind it, and what the engine produced, to compare the
clients' audio with."""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from agent_server.protocols import routes
from agent_server.settings import Settings
from synth.api import OUTPUT_SAMPLE_RATE_HZ

from tests.agent_server.fake_engine import FakeEngine
from tests.agent_server.live_server import LiveServer, live_server, make_test_certificate

# The drain at a segment's end pads a few ms of silence (resampler delay + partial frame).
PAD_PER_SEGMENT_S = 0.06


@pytest.fixture(scope="session")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    return make_test_certificate(tmp_path_factory.mktemp("tls"))


@dataclass
class Served:
    live: LiveServer
    engine: FakeEngine

    @property
    def http(self) -> str:
        return self.live.http_url

    @property
    def ws(self) -> str:
        return self.live.http_url.replace("http", "ws", 1)

    @property
    def grpc(self) -> str:
        """host:port of the gRPC server (Riva)."""
        port = self.live.hub.settings.grpc_port
        assert port, "started without grpc=True"
        return f"127.0.0.1:{port}"

    def produced(self, cancelled_ok: bool = False) -> tuple[int, int]:
        """(24 kHz samples the engine produced for the segments it was given, number of segments)."""
        total = 0
        for request in self.engine.submits:
            if request.request_id in self.engine.cancels and not cancelled_ok:
                continue
            seed = self.engine.seed_of(request.request_id)
            total += len(FakeEngine.expected_tokens(request.text, seed, self.engine.tokens_per_char)) * 960
        return total, len(self.engine.submits)


def assert_length(served: Served, n_bytes: int, rate_hz: int, bytes_per_sample: int = 2) -> None:
    """The client got the audio the engine produced, resampled to the rate it asked for."""
    produced_24k, segments = served.produced()
    assert produced_24k > 0
    got = n_bytes // bytes_per_sample
    expected = produced_24k * rate_hz / OUTPUT_SAMPLE_RATE_HZ
    assert n_bytes % bytes_per_sample == 0
    assert expected - 2 <= got <= expected + segments * PAD_PER_SEGMENT_S * rate_hz, (got, expected)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start(tmp_path: Path, tls: tuple[Path, Path] | None = None, *, grpc: bool = False, api_keys: tuple[str, ...] = (),
          **engine_options: object) -> Iterator[Served]:
    engine = FakeEngine(**engine_options)  # type: ignore[arg-type]
    settings = Settings(data_dir=tmp_path, api_keys=api_keys, grpc_port=free_port() if grpc else 0)
    if tls is not None:
        settings = settings.replace(tls_certfile=str(tls[0]), tls_keyfile=str(tls[1]))
    with live_server(engine, settings, extra_routes=routes()) as live:
        yield Served(live, engine)


serving = contextlib.contextmanager(start)  # `with serving(tmp_path, ...) as served:` in a test of its own


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from start(tmp_path)


@pytest.fixture
def served_tls(tmp_path: Path, tls_cert: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_cert[0]))  # how the unmodified SDKs trust it
    yield from start(tmp_path, tls_cert)


@pytest.fixture
def served_realtime(tmp_path: Path) -> Iterator[Served]:
    """Audio at the pace of speech, so that a barge-in lands while the engine is still generating."""
    yield from start(tmp_path, realtime_factor=1.0)


@pytest.fixture
def served_grpc_realtime(tmp_path: Path) -> Iterator[Served]:
    """`served_realtime` with the Riva gRPC service on its own port."""
    yield from start(tmp_path, grpc=True, realtime_factor=1.0)


def pcm16(data: bytes) -> NDArray[Any]:
    return np.frombuffer(data, dtype="<i2")
