"""The server's log is JSON lines only: structlog's, the standard library's and Python warnings alike."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Iterator

import orjson
import pytest
import structlog

from agent_server.logging import configure_logging


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
    """torch's `sdp_kernel()` FutureWarning (chatterbox's perceiver calls it) used to land on stderr as two bare
    lines between the JSON ones, breaking whoever parses the log line by line."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("`torch.backends.cuda.sdp_kernel()` is deprecated", FutureWarning, stacklevel=1)
    structlog.get_logger("agent_server.test").info("after")
    lines = [orjson.loads(line) for line in log_stream.getvalue().splitlines()]  # every line parses
    assert [line["logger"] for line in lines] == ["py.warnings", "agent_server.test"]
    assert lines[0]["level"] == "warning" and "sdp_kernel" in lines[0]["event"]
