"""structlog configuration: one JSON object per line on stderr, for our logs and uvicorn's alike.

Our loggers bind `session_id`, `protocol` and `context_id` (session.py); anything bound with
`structlog.contextvars.bind_contextvars` is merged in as well.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
          "info": logging.INFO, "debug": logging.DEBUG}
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


def _dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=repr).decode()


def configure_logging(level: str = "info", *, stream: Any = None) -> None:
    """Route structlog and the standard library (uvicorn included) to one JSON-lines handler."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(LEVELS[level])
    for name in UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers = []
        uvicorn_logger.propagate = True
