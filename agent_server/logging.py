"""structlog configuration: one JSON object per line on stderr, for our logs and uvicorn's alike.

Our loggers bind `session_id`, `protocol` and `context_id` (session.py); anything bound with
`structlog.contextvars.bind_contextvars` is merged in as well.

Credentials never reach the log: every line, uvicorn's access and WebSocket lines included, passes
`redact_credentials`, which blanks the value of every query parameter a credential can travel in (the
names fleet/auth.py reads, and more, however they are percent-encoded) and of `Bearer` / `Token`
authorizations.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import warnings
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import unquote_plus

import orjson
import structlog

LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
          "info": logging.INFO, "debug": logging.DEBUG}
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
REDACTED = "[redacted]"
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# Deprecation notices chatterbox's dependencies print at every start (its watermarker's pkg_resources import,
# diffusers' LoRA layer, torch's sdp_kernel context in its perceiver): not ours to fix, nothing to act on.
LIBRARY_NOTICES: tuple[tuple[str, type[Warning]], ...] = (
    (r"pkg_resources is deprecated", UserWarning),
    (r"`LoRACompatibleLinear` is deprecated", FutureWarning),
    (r"`torch\.backends\.cuda\.sdp_kernel\(\)` is deprecated", FutureWarning),
)
# every query parameter a credential can travel in: the names fleet/auth.py reads (its QUERY_NAMES, held to this
# by tests/agent_server/test_logging.py) and those other clients use
CREDENTIAL_QUERY_NAMES = frozenset({"token", "access_token", "api_key", "xi_api_key", "xi-api-key", "authorization",
                                    "key"})
_QUERY_PAIR = re.compile(r"(?P<lead>[?&;])(?P<name>[^=&;\s\"'#]+)=(?P<value>[^&;\s\"'#]*)")
# the schemes as clients write them (`Authorization: Bearer K`, Deepgram's `Token K`) before a credential
_AUTH_SCHEME = re.compile(r"\b(?P<scheme>Bearer|bearer|Token|Basic)(?P<gap>\s+)[A-Za-z0-9._~+/=-]{8,}")


def redact(text: str) -> str:
    """`text` with credential values in query strings and Authorization-like phrases blanked."""
    if "=" in text:
        text = _QUERY_PAIR.sub(_redact_pair, text)
    return _AUTH_SCHEME.sub(lambda m: f"{m['scheme']}{m['gap']}{REDACTED}", text)


def _redact_pair(match: re.Match[str]) -> str:
    if unquote_plus(match["name"]).strip().lower() in CREDENTIAL_QUERY_NAMES:
        return f"{match['lead']}{match['name']}={REDACTED}"
    return match[0]


def redact_credentials(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `redact` every string value of the line."""
    for key, value in event_dict.items():
        if isinstance(value, str):
            event_dict[key] = redact(value)
    return event_dict


class RateLimitedLog:
    """At most one line per `period_s` for an event any client can trigger at will (so a client cannot
    flood the log); each line says how many were left out since the previous one. Event loop only."""

    def __init__(self, logger: Any, event: str, period_s: float) -> None:
        self.logger = logger
        self.event = event
        self.period_s = period_s
        self._last_s: float | None = None
        self._suppressed = 0

    def emit(self, **fields: Any) -> bool:
        """Log the event now unless one was logged less than `period_s` ago; True when logged."""
        now_s = time.monotonic()
        if self._last_s is not None and now_s - self._last_s < self.period_s:
            self._suppressed += 1
            return False
        self.logger.warning(self.event, suppressed=self._suppressed, **fields)
        self._last_s, self._suppressed = now_s, 0
        return True


def _dumps(obj: Any, **_: Any) -> str:
    return orjson.dumps(obj, default=repr).decode()


def configure_logging(level: str = "info", *, stream: Any = None) -> None:
    """Route structlog, the standard library (uvicorn included) and Python warnings (a library's deprecation
    notice, say) to one JSON-lines handler: nothing else is written to stderr between the JSON lines."""
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
            redact_credentials,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(_not_a_library_notice)
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(LEVELS[level])
    logging.captureWarnings(True)  # warnings.warn(...) -> logger "py.warnings", level warning
    for message, category in LIBRARY_NOTICES:  # at every start, and nothing an operator can act on
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in UVICORN_LOGGERS:
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers = []
        uvicorn_logger.propagate = True
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _PassedProbes) for f in access.filters):
        access.addFilter(_PassedProbes())


def _not_a_library_notice(record: logging.LogRecord) -> bool:
    """chatterbox's flow model logs its frame rate on the root logger each time one is built."""
    return not (record.name == "root" and str(record.msg).startswith("input frame rate="))


class _PassedProbes(logging.Filter):
    """Leaves out the access lines of probes that passed (`/healthz`, `/readyz` answered 2xx: a balancer and
    a kubelet ask several times a second); a failed probe (503: loading, draining) is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:  # uvicorn's: client, method, path, version, status
            return True
        path, status = args[2], args[4]
        return not (path in PROBE_PATHS and isinstance(status, int) and 200 <= status < 300)
