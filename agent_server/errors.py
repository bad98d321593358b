"""FieldError: the one error type for a request the server refuses, whatever the protocol.

Every parser (native, vendor, HTTP body), the stream spec builder, the session core's text limits and
`hub.open_stream` raise (or, for the native parser, return) a `FieldError`; each protocol then renders it
in its own wire form. `field` is a dotted path into the client's message ("output_format.sample_rate_hz",
"text", "message" for a message that is not a JSON object, "" when no field is at fault).
"""

from __future__ import annotations

# Codes shared by every protocol (a protocol may use others of its own).
BAD_REQUEST = "bad_request"
EMPTY_MESSAGE = "empty_message"  # a message that should carry text carries none
TEXT_TOO_LONG = "text_too_long"  # one piece over Settings.max_text_piece_chars
CONTEXT_TEXT_LIMIT = "context_text_limit"  # a context over Settings.max_context_text_chars
RATE_LIMITED = "rate_limited"  # the API key's text-per-minute budget is spent
BUSY = "busy"  # no room: try again later
UNAVAILABLE = "unavailable"  # busy because the server is not serving (loading, shutting down, failed)


class FieldError(ValueError):
    """A request refused: `field` is at fault. `busy` means "try again later" rather than "fix it"."""

    def __init__(
        self, field: str, message: str, code: str = BAD_REQUEST, *, context_id: str | None = None, busy: bool = False
    ) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code
        self.context_id = context_id
        self.busy = busy

    def __repr__(self) -> str:
        return f"FieldError({self.field!r}, {self.message!r}, {self.code!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FieldError):
            return NotImplemented
        return (self.field, self.message, self.code, self.context_id, self.busy) == (
            other.field, other.message, other.code, other.context_id, other.busy
        )

    def __hash__(self) -> int:
        return hash((self.field, self.message, self.code, self.context_id, self.busy))


def empty_message(context_id: str | None = None, field: str = "text") -> FieldError:
    """The one answer to a message that should carry text and carries none, in every protocol."""
    return FieldError(field, "the message carries no text", EMPTY_MESSAGE, context_id=context_id)
