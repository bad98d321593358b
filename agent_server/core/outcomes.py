"""How a session ends, and what each kind of endpoint answers for it: the one table of outcomes.

A session of any protocol (a WebSocket, an HTTP request, a gRPC call: agent_server/core/session.py) ends in one
`Outcome`. Its `Answer` is what the client gets: the WebSocket close code, the HTTP status of the error response
when no answer started yet (once audio went out, a response that fails is cut instead), the gRPC status of the
call. Transports render an outcome from this table only (core/transport.py, core/grpc_server.py); the HTTP
speech base answers with its statuses (protocols/http_speech.py). docs/operations.md shows the same table, and
tests/agent_server/core/test_outcomes.py holds the two against each other.

Refusals of access (no key, a wrong key: fleet/auth.py) come before any session and are not outcomes. The jobs API
(agent_server/jobs/api.py) answers its requests from this table too: three rows exist for it (NOT_FOUND, NO_RESULT,
OUT_OF_RANGE: a WebSocket or gRPC session never ends that way), and its other refusals are the rows every protocol
shares (a field at fault is a 422 there, the native HTTP shape's answer to `bad_request`, as ElevenLabs' is).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from agent_server.core.events import StreamStatus
from agent_server.errors import RATE_LIMITED, UNAVAILABLE, FieldError

# WebSocket close codes (RFC 6455 7.4.1) the table answers with, and two a client's side may end with
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001  # the server is shutting down; an HTTP session whose client left records it too
CLOSE_INVALID_PAYLOAD = 1007  # a text frame that is not UTF-8 (the WebSocket layer closes with it)
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009  # a message (WebSocket) or body (HTTP) over the limit
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013


class Outcome(enum.Enum):
    """Every way a session ends. The value is its wire name (an HTTP error's `code` where nothing more precise
    names it)."""

    COMPLETED = "completed"  # the answer went out whole (or the client ended the session normally)
    BAD_INPUT = "bad_request"  # the client's request is wrong (a field, a limit of the text, the protocol's rules)
    TOO_LARGE = "body_too_large"  # a message (WebSocket) or body (HTTP) over `max_message_bytes`
    OVER_LIMIT = "rate_limited"  # the API key's text budget is spent (or cannot be checked now)
    BUSY = "busy"  # no room: sessions, the key's sessions, contexts per session, the engine's slots or inbox
    NOT_READY = "not_ready"  # the server is not serving: loading, draining, the engine failed
    DRAIN_CUT = "shutting_down"  # the drain ended it (idle, or still running when the grace ran out)
    CLIENT_GONE = "client_gone"  # the client closed or went away
    SLOW_CLIENT = "slow_client"  # the client took none of its audio for `slow_client_stall_s` (or fell behind)
    FAILED = "failed"  # the engine failed a segment, or its audio encoder failed
    INTERNAL_ERROR = "internal_error"  # a bug (an exception in a protocol's hook or the core)
    NOT_FOUND = "not_found"  # what was asked for does not exist, or is no longer kept (a job, after --job-ttl-s)
    NO_RESULT = "no_result"  # what was asked for has no result: the audio of a job that failed or was cancelled
    OUT_OF_RANGE = "range_not_satisfiable"  # a byte range outside the file asked for

    @property
    def answer(self) -> Answer:
        return ANSWERS[self]

    @property
    def close_code(self) -> int:
        return ANSWERS[self].close_code

    @property
    def http_status(self) -> int | None:
        return ANSWERS[self].http_status

    @classmethod
    def of_error(cls, error: FieldError) -> Outcome:
        """The outcome of a refused request (`session.reject`), when the protocol ends the session for it."""
        if error.busy:
            return cls.NOT_READY if error.code == UNAVAILABLE else cls.BUSY
        return cls.OVER_LIMIT if error.code == RATE_LIMITED else cls.BAD_INPUT

    @classmethod
    def of_stream(cls, status: StreamStatus) -> Outcome:
        """The outcome of a context's stream that ended with `status` (its StreamDone), for a protocol whose
        session ends with its context."""
        return _OF_STREAM[status]


@dataclass(frozen=True, slots=True)
class Answer:
    close_code: int  # WebSocket (CLIENT_GONE: what the session records; the client's own code when it sent one)
    http_status: int | None  # an HTTP error response's; None: none goes out (the answer had started, or nobody is left)
    grpc_status: str  # grpc.StatusCode's name


# THE table. docs/operations.md ("How a session ends") shows it row for row.
ANSWERS: Mapping[Outcome, Answer] = {
    Outcome.COMPLETED: Answer(CLOSE_NORMAL, 200, "OK"),
    Outcome.BAD_INPUT: Answer(CLOSE_POLICY, 400, "INVALID_ARGUMENT"),
    Outcome.TOO_LARGE: Answer(CLOSE_TOO_BIG, 413, "RESOURCE_EXHAUSTED"),
    Outcome.OVER_LIMIT: Answer(CLOSE_POLICY, 429, "RESOURCE_EXHAUSTED"),
    Outcome.BUSY: Answer(CLOSE_TRY_AGAIN_LATER, 429, "RESOURCE_EXHAUSTED"),
    Outcome.NOT_READY: Answer(CLOSE_TRY_AGAIN_LATER, 503, "RESOURCE_EXHAUSTED"),
    Outcome.DRAIN_CUT: Answer(CLOSE_GOING_AWAY, 503, "UNAVAILABLE"),
    Outcome.CLIENT_GONE: Answer(CLOSE_GOING_AWAY, None, "CANCELLED"),
    Outcome.SLOW_CLIENT: Answer(CLOSE_POLICY, 400, "INVALID_ARGUMENT"),
    Outcome.FAILED: Answer(CLOSE_INTERNAL_ERROR, 503, "INTERNAL"),
    Outcome.INTERNAL_ERROR: Answer(CLOSE_INTERNAL_ERROR, 500, "INTERNAL"),
    Outcome.NOT_FOUND: Answer(CLOSE_POLICY, 404, "NOT_FOUND"),
    Outcome.NO_RESULT: Answer(CLOSE_POLICY, 409, "FAILED_PRECONDITION"),
    Outcome.OUT_OF_RANGE: Answer(CLOSE_POLICY, 416, "OUT_OF_RANGE"),
}
_OF_STREAM: Mapping[StreamStatus, Outcome] = {
    StreamStatus.COMPLETED: Outcome.COMPLETED,
    StreamStatus.CANCELLED: Outcome.CLIENT_GONE,
    StreamStatus.BUSY: Outcome.BUSY,
    StreamStatus.FAILED: Outcome.FAILED,
    StreamStatus.SHUTDOWN: Outcome.DRAIN_CUT,
}


def http_status(outcome: Outcome) -> int:
    """An outcome's HTTP status, for one that has one."""
    status = outcome.http_status
    if status is None:
        raise ValueError(f"{outcome.name} answers no HTTP status")
    return status


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a session was not admitted: `outcome` BUSY (a session limit) or NOT_READY (loading, shutting down,
    failed). The protocol says it in its own form (`on_refused`); the session then ends with that outcome."""

    reason: str
    outcome: Outcome
