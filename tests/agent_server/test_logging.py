"""The server's log is JSON lines only: structlog's, the standard library's and Python warnings alike."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator

import orjson
import pytest
import structlog

from agent_server.fleet.auth import QUERY_NAMES
from agent_server.logging import CREDENTIAL_QUERY_NAMES, configure_logging, redact


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging("info", stream=stream)
    try:
        yield stream
    finally:
        logging.captureWarnings(False)
        root.handlers, root.level = handlers, level
        structlog.reset_defaults()


def test_a_libraries_warning_is_a_json_line(log_stream: io.StringIO) -> None:
    """A library's warning (torch's `sdp_kernel()` FutureWarning was one) used to land on stderr as two bare
    lines between the JSON ones, breaking whoever parses the log line by line."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("`somelib.thing()` is deprecated", FutureWarning, stacklevel=1)
    structlog.get_logger("agent_server.test").info("after")
    lines = [orjson.loads(line) for line in log_stream.getvalue().splitlines()]  # every line parses
    assert [line["logger"] for line in lines] == ["py.warnings", "agent_server.test"]
    assert lines[0]["level"] == "warning" and "somelib" in lines[0]["event"]


def test_the_notices_chatterbox_s_dependencies_print_at_every_start_are_left_out(log_stream: io.StringIO) -> None:
    warnings.warn("pkg_resources is deprecated as an API.", UserWarning, stacklevel=1)
    warnings.warn("`LoRACompatibleLinear` is deprecated and will be removed", FutureWarning, stacklevel=1)
    warnings.warn("`torch.backends.cuda.sdp_kernel()` is deprecated.", FutureWarning, stacklevel=1)
    logging.getLogger().warning("input frame rate=25")  # (chatterbox logs it at info; the level does not matter)
    assert log_stream.getvalue() == ""
    logging.getLogger().warning("something else")
    assert "something else" in log_stream.getvalue()


def test_a_probe_that_passed_is_not_logged_a_failed_one_is(log_stream: io.StringIO) -> None:
    """A balancer and a kubelet probe several times a second: their passing checks would be most of the log."""
    access = logging.getLogger("uvicorn.access")
    access.setLevel(logging.INFO)
    line = '%s - "%s %s HTTP/%s" %d'
    for path, status in (("/readyz", 200), ("/healthz", 200), ("/readyz", 503), ("/v1/status", 200)):
        access.info(line, "10.0.0.1:5000", "GET", path, "1.1", status)
    logged = [orjson.loads(raw)["event"] for raw in log_stream.getvalue().splitlines()]
    assert logged == ['10.0.0.1:5000 - "GET /readyz HTTP/1.1" 503', '10.0.0.1:5000 - "GET /v1/status HTTP/1.1" 200']


def test_every_query_name_auth_reads_a_credential_from_is_redacted() -> None:
    assert set(QUERY_NAMES) <= CREDENTIAL_QUERY_NAMES
    for name in QUERY_NAMES:
        assert redact(f"GET /v1/stream?{name}=sk-secret-value&x=1") == f"GET /v1/stream?{name}=[redacted]&x=1"
