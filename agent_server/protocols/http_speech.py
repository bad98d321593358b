"""What every vendor's text-to-speech HTTP endpoint shares, on the session core: one session and one
context per request (core/transport.py's HttpTransport: the body is the one message).

A vendor module subclasses `HttpSpeechProtocol` and writes only its wire format:
- `parse(body)`: the request -> `HttpSpeechRequest` (the stream spec, the text, the vendor's per-context state),
  raising FieldError naming the field at fault;
- `head(ctx)`: the response head; `render_audio`, `render_segment`, `render_completed`: the body;
- `error_body(status, code, message, field)`: an error in the vendor's shape.

What this class does the same for every vendor:
- the status line waits for the first audio (or the end of a response with none), so that a request
  refused before any audio gets a real status, its outcome's from the one table (core/outcomes.py): 400 (bad
  request; a vendor may answer its own, e.g. ElevenLabs' 422), 413 (body too large), 429 (busy, rate
  limited), 503 (not ready, shutting down, generation failed), 500 (a bug). Once audio went out, a failure
  ends the body early.
- the client closing the response cancels the context (barge-in; the engine slot is free at the next
  step): the session core's teardown does it.
- the text is pushed through the core (`push_text`: the server's text limits and the key's budget) and
  the input ended at once.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Generic

from agent_server.core.events import AudioOut, SegmentDone, StreamDone, StreamEvent, StreamSpec
from agent_server.core.outcomes import Outcome, Refusal, http_status
from agent_server.core.routing import SERVED_MODEL_HEADER
from agent_server.core.session import Context, S, Session, WireProtocol
from agent_server.core.transport import Head
from agent_server.errors import CONTEXT_TEXT_LIMIT, RATE_LIMITED, TEXT_TOO_LONG, FieldError

NOTHING_TO_SAY = "nothing_to_say"
# the session core's errors about the text it was given (field "text"): named by the vendor's own field
SESSION_TEXT_CODES = frozenset({TEXT_TOO_LONG, CONTEXT_TEXT_LIMIT, RATE_LIMITED, "bad_markup"})
# the statuses a vendor's `error_body` may tell apart (from the one table: core/outcomes.py)
STATUS_BAD_REQUEST = http_status(Outcome.BAD_INPUT)
STATUS_TOO_LARGE = http_status(Outcome.TOO_LARGE)
STATUS_BUSY = http_status(Outcome.BUSY)
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Turn:
    """A line of a dialogue: its text, said by its own voice (`SpeechStream.start_turn`)."""

    voice_id: str
    text: str


@dataclass(frozen=True, slots=True)
class HttpSpeechRequest(Generic[S]):
    """One parsed request: what to open, what to say, the vendor's state for the context. A dialogue
    gives `turns` (`text` is then their concatenation, for the record): each is pushed as its own turn."""

    spec: StreamSpec
    text: str
    state: S
    turns: tuple[Turn, ...] = ()


class HttpSpeechProtocol(WireProtocol[S]):
    context_id: ClassVar[str] = "speech"
    text_field: ClassVar[str] = "text"  # the body field that carries the text (errors name it)

    def __init__(self, session: Session[S]) -> None:
        super().__init__(session)
        self.head_sent = False

    # ---- the vendor's part -------------------------------------------------------------------------

    def parse(self, body: bytes) -> HttpSpeechRequest[S]:
        """The request (its body; the query, path and headers are on `self.session.transport`)."""
        raise NotImplementedError

    def head(self, ctx: Context[S]) -> Head:
        raise NotImplementedError

    def error_body(self, status: int, code: str, message: str, field: str | None) -> tuple[int, bytes]:
        """(status, JSON body) of an error: `status` as this class chose it, or the vendor's own."""
        raise NotImplementedError

    def render_audio(self, ctx: Context[S], event: AudioOut) -> None:
        self.session.send_audio(ctx, event.payload, event.duration_ms)

    def render_segment(self, ctx: Context[S], event: SegmentDone) -> None:
        """A segment's audio is all out (timestamps)."""

    def render_completed(self, ctx: Context[S]) -> None:
        """The last words of a completed response, after its audio."""

    def render_failed(self, ctx: Context[S], status: int, code: str, message: str) -> None:
        """The last words of a response that failed after its audio started (then the body ends)."""

    # ---- the request -----------------------------------------------------------------------------

    async def on_message(self, message: str | bytes, now_s: float) -> None:
        session = self.session
        if self.head_sent:
            return
        try:
            speech = self.parse(message if isinstance(message, bytes) else message.encode())
        except FieldError as error:
            session.reject(error)
            return
        ctx = await session.open_context(self.context_id, speech.spec, speech.state)
        if ctx is None:
            return
        for turn in speech.turns or (Turn(speech.spec.voice_id, speech.text),):
            if speech.turns:
                ctx.stream.start_turn(turn.voice_id, now_s)
            if not await session.push_text(ctx, turn.text, now_s):
                ctx.stream.cancel()
                return
        ctx.stream.end(now_s)

    # ---- refusals and errors: a status line while none went out ------------------------------------

    def on_refused(self, refusal: Refusal) -> None:
        self._error_response(refusal.outcome, refusal.outcome.value, refusal.reason, None)

    def render_error(self, error: FieldError) -> None:
        outcome = Outcome.of_error(error)
        if self.head_sent:
            self.session.close(outcome, error.message)
            return
        field = error.field or None
        if field == "text" and error.code in SESSION_TEXT_CODES:  # the session core's name for the text
            field = self.text_field
        code = error.code if outcome is Outcome.BAD_INPUT else outcome.value  # busy, not_ready, rate_limited
        self._error_response(outcome, code, error.message, field)
        self.session.close(outcome, error.message)

    def on_close(self, outcome: Outcome, reason: str) -> None:
        if not self.head_sent:
            self._error_response(outcome, outcome.value, reason or outcome.value, None)

    def _error_response(self, outcome: Outcome, code: str, message: str, field: str | None) -> None:
        """The error response of `outcome`, its status from the one table (none of its own: a bug's, 500)."""
        self.head_sent = True
        status = outcome.http_status or http_status(Outcome.INTERNAL_ERROR)
        status, body = self.error_body(status, code, message, field)
        self.session.send(Head(status, JSON))
        self.session.send(body)

    # ---- the audio ---------------------------------------------------------------------------------

    def _nothing_to_say(self, ctx: Context[S]) -> bool:
        """No answer started and the text made no segment (no letter or digit in it)."""
        return not self.head_sent and ctx.stream.segment_count == 0

    def _start(self, ctx: Context[S]) -> None:
        self.head_sent = True
        head = self.head(ctx)
        served = ((SERVED_MODEL_HEADER, ctx.stream.spec.model),) if ctx.stream.spec.model else ()
        self.session.send(dataclasses.replace(head, headers=(*head.headers, *served)))

    def render(self, ctx: Context[S], event: StreamEvent) -> None:
        if isinstance(event, AudioOut):
            if self._nothing_to_say(ctx):
                return  # a container's header for no audio at all (WAV): the answer is the 400 below
            if not self.head_sent:
                self._start(ctx)
            self.render_audio(ctx, event)
        elif isinstance(event, SegmentDone):
            if not self.head_sent:  # a segment without audio: the engine did its work, the answer is 200
                self._start(ctx)
            self.render_segment(ctx, event)
        elif isinstance(event, StreamDone):
            self._render_done(ctx, event)

    def _render_done(self, ctx: Context[S], event: StreamDone) -> None:
        session = self.session
        outcome = Outcome.of_stream(event.status)
        if outcome is Outcome.COMPLETED:
            if self._nothing_to_say(ctx):  # "...", "👍": a 400, never an empty file
                self.render_error(FieldError(self.text_field, "the text has nothing to say (no letter or digit)",
                                             NOTHING_TO_SAY))
                return
            if not self.head_sent:
                self._start(ctx)  # segments without audio (pauses of no length): a body without audio
            self.render_completed(ctx)
            session.close(outcome, "")
            return
        if self.head_sent:  # a failure after audio started ends the body early
            if outcome.http_status is not None:  # (a cancel has no one to tell)
                self.render_failed(ctx, outcome.http_status, event.reason, event.detail or event.reason)
            session.close(outcome, event.detail or event.reason)
        elif outcome is Outcome.BUSY:
            self._error_response(outcome, outcome.value, event.detail or "no free slot", None)
            session.close(outcome, event.detail)
        else:
            self._error_response(outcome, event.reason, event.detail or "generation failed", None)
            session.close(outcome, event.detail)


class Base64Stream:
    """Base64 of a byte stream that arrives in pieces of any length, as pieces of one base64 text
    (a JSON string written as the audio comes: each piece but the last encodes a multiple of 3 bytes)."""

    def __init__(self) -> None:
        self._carry = b""

    def push(self, data: bytes) -> bytes:
        data = self._carry + data
        whole = len(data) - len(data) % 3
        self._carry = data[whole:]
        return base64.b64encode(data[:whole])

    def finish(self) -> bytes:
        tail, self._carry = self._carry, b""
        return base64.b64encode(tail)
