"""Hub: the server's shared runtime, one per app (`app.state.hub`).

It owns the engine (built and warmed up on a daemon thread so /healthz answers while the model loads),
the voice store, the observers, the registry of open sessions of every protocol, the ticker (segmenter
polls and the slow-client watchdog) and the shutdown drain.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import secrets
import threading
import time
from typing import Any, Callable, Protocol

import structlog

from agent_server.auth import AUTH_OFF_WARNING, Auth
from agent_server.observers import Observers
from agent_server.settings import Settings
from agent_server.speech import Emit, SegmenterLike, SpeechStream, StreamDone, StreamEvent, StreamSpec
from agent_server.voices import VoiceError, VoiceStore
from synth.api import EngineLike

log = structlog.get_logger("agent_server.hub")

ENGINE_READY_POLL_S = 0.02
ENGINE_ALIVE_CHECK_S = 0.5
DRAIN_POLL_S = 0.05
RANDOM_WEIGHTS_WARNING = (
    "THE MODEL RUNS ON RANDOM WEIGHTS: the audio is noise. Give --weights a checkpoint directory "
    "(or let 'auto' find or download one) for real speech."
)

EngineFactory = Callable[[Settings], EngineLike]
SegmenterFactory = Callable[[], SegmenterLike]


class ServerStatus(enum.IntEnum):
    LOADING = 0  # building and warming up the engine
    READY = 1
    DRAINING = 2  # shutting down: no new sessions or contexts, in-flight speech may finish
    STOPPED = 3
    FAILED = 4  # the engine failed to load or its thread died


class OpenRefused(Exception):
    """A stream could not be opened: `busy` (try again later) or a client error naming `field`."""

    def __init__(self, busy: bool, field: str, message: str, code: str) -> None:
        super().__init__(message)
        self.busy = busy
        self.field = field
        self.message = message
        self.code = code


class Session(Protocol):
    """What the hub needs from a session of any protocol (see session.Connection)."""

    session_id: str
    protocol_name: str

    def tick(self, now_s: float) -> None: ...
    def begin_drain(self) -> None: ...
    def close_now(self, code: int, reason: str) -> None: ...
    def fail_streams(self, detail: str) -> None: ...
    @property
    def live_streams(self) -> int: ...


class Hub:
    def __init__(
        self,
        settings: Settings,
        *,
        engine: EngineLike | None = None,
        engine_factory: EngineFactory | None = None,
        segmenter_factory: SegmenterFactory | None = None,
    ) -> None:
        if (engine is None) == (engine_factory is None):
            raise ValueError("give exactly one of engine, engine_factory")
        self.settings = settings
        self.auth = Auth.from_settings(settings)  # raises AuthConfigError (a ValueError) on unusable settings
        self.observers = Observers()
        self.voices = VoiceStore(
            settings.voices_dir, min_clip_s=settings.min_voice_clip_s, max_clip_s=settings.max_voice_clip_s
        )
        self.status = ServerStatus.LOADING
        self.detail = "loading the model"
        self.engine: EngineLike | None = None  # set once built (it is ready once status is READY)
        self.sessions: set[Session] = set()
        self.make_segmenter = segmenter_factory or _default_segmenter_factory()
        self._given_engine = engine
        self._engine_factory = engine_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._session_numbers = itertools.count(1)
        self._instance = secrets.token_hex(3)
        self._started_monotonic_s = time.monotonic()
        # Called once when the engine fails to load or its thread dies, after the sessions were failed.
        # The CLI sets it to shut the server down and exit non-zero, so that a supervisor restarts it
        # (a dead engine cannot be revived in-process); without it the server stays up, not ready.
        self.on_engine_failed: Callable[[str], None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.auth.announce()
        self._tasks = [
            asyncio.create_task(self._load(), name="hub-load"),
            asyncio.create_task(self._tick(), name="hub-tick"),
        ]

    async def stop(self) -> None:
        """After drain: stop the ticker and the engine."""
        if self.status < ServerStatus.STOPPED:
            self.status = ServerStatus.STOPPED
            self.detail = "stopped"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        engine = self.engine or self._given_engine
        if engine is not None and engine.alive:
            await asyncio.to_thread(engine.stop)
        log.info("server_stopped")

    async def drain(self, grace_s: float, give_up: Callable[[], bool] = lambda: False) -> None:
        """Stop taking work, let in-flight speech finish for up to `grace_s` (or until `give_up()`),
        then close what is left with 1001."""
        if self.status >= ServerStatus.DRAINING and not self.sessions:
            return
        if self.status < ServerStatus.DRAINING:
            self.status = ServerStatus.DRAINING
            self.detail = "shutting down"
        log.info("drain_started", sessions=len(self.sessions), grace_s=grace_s)
        for session in list(self.sessions):
            session.begin_drain()
        deadline_s = time.monotonic() + grace_s
        while self.sessions and time.monotonic() < deadline_s and not give_up():
            await asyncio.sleep(DRAIN_POLL_S)
        if self.sessions:
            log.warning("drain_deadline", sessions=len(self.sessions))
            for session in list(self.sessions):
                session.close_now(1001, "server shutting down")
            deadline_s = time.monotonic() + self.settings.close_timeout_s + 1.0
            while self.sessions and time.monotonic() < deadline_s:
                await asyncio.sleep(DRAIN_POLL_S)
        log.info("drain_done", sessions_left=len(self.sessions))

    # ---- sessions ------------------------------------------------------------------------------

    def new_session_id(self) -> str:
        return f"{self._instance}-{next(self._session_numbers)}"

    def admit(self, session: Session) -> str | None:
        """Register a session, or say why not (then the caller sends busy and closes with 1013)."""
        if self.status != ServerStatus.READY:
            return {
                ServerStatus.LOADING: "starting: the model is loading",
                ServerStatus.DRAINING: "shutting down",
                ServerStatus.STOPPED: "shutting down",
                ServerStatus.FAILED: "the engine failed",
            }[self.status]
        if len(self.sessions) >= self.settings.max_sessions:
            return f"too many sessions (at most {self.settings.max_sessions})"
        refusal = self.auth.acquire_session(getattr(session, "principal", None))
        if refusal is not None:
            return refusal
        self.sessions.add(session)
        return None

    def remove(self, session: Session) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            self.auth.release_session(getattr(session, "principal", None))

    def open_stream(self, key: str, spec: StreamSpec, emit: Emit) -> SpeechStream:
        """A SpeechStream on the engine (not opened yet: call `.open()`). Its voice is leased until the
        stream's StreamDone. Any protocol, WebSocket or HTTP, gets its streams here. Raises OpenRefused."""
        engine = self.engine
        if engine is None or not self.ready:
            raise OpenRefused(True, "", f"the server is not ready: {self.detail}", "not_ready")
        try:
            voice = self.voices.acquire(spec.voice_id)
        except VoiceError as exc:
            raise OpenRefused(False, "voice", exc.message, exc.code) from None

        def emit_then_release(stream: SpeechStream, event: StreamEvent) -> None:
            emit(stream, event)
            if isinstance(event, StreamDone):
                self.voices.release(voice)

        return SpeechStream(key, spec, engine=engine, segmenter=self.make_segmenter(), post=self.post,
                            emit=emit_then_release)

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the event loop; callable from any thread (the engine's sinks use it)."""
        assert self._loop is not None, "hub not started"
        self._loop.call_soon_threadsafe(fn, *args)

    @property
    def ready(self) -> bool:
        return self.status == ServerStatus.READY

    @property
    def alive(self) -> bool:
        return self.status != ServerStatus.FAILED

    def status_json(self) -> dict[str, Any]:
        engine = self.engine
        engine_status: dict[str, Any] = engine.status() if engine is not None else {}
        random_weights = engine.random_weights if engine is not None else None
        warnings = [RANDOM_WEIGHTS_WARNING] if random_weights else []
        if not self.auth.enabled:
            warnings.append(AUTH_OFF_WARNING)
        return {
            "status": self.status.name.lower(),
            "detail": self.detail,
            "ready": self.ready,
            "variant": engine.variant if engine is not None else self.settings.variant,
            "random_weights": random_weights,
            "weights": self.settings.weights,
            "weights_source": engine_status.get("weights_source"),
            "engine": engine_status,
            "sessions": len(self.sessions),
            "contexts": sum(s.live_streams for s in self.sessions),
            "max_sessions": self.settings.max_sessions,
            "uptime_s": round(time.monotonic() - self._started_monotonic_s, 3),
            "auth": self.auth.status_json(),
            "warnings": warnings,
        }

    # ---- tasks ---------------------------------------------------------------------------------

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        built: asyncio.Future[EngineLike] = loop.create_future()

        def build() -> None:  # a daemon thread: a model that is still loading never blocks shutdown
            try:
                result: EngineLike | BaseException = self._build_and_start()
            except BaseException as exc:  # handed to the loop
                result = exc
            try:
                loop.call_soon_threadsafe(_settle, built, result)
            except RuntimeError:
                pass  # the loop closed while loading

        threading.Thread(target=build, name="engine-loader", daemon=True).start()
        try:
            engine = await built
            self.engine = engine
            await self.voices.attach(engine)
        except Exception as exc:
            self.status = ServerStatus.FAILED
            self.detail = f"engine failed to load: {exc}"
            log.exception("engine_load_failed")
            self._report_failure()
            return
        if self.status == ServerStatus.LOADING:
            self.status = ServerStatus.READY
            self.detail = "ready"
        log.info(
            "server_ready",
            variant=engine.variant,
            random_weights=engine.random_weights,
            max_slots=engine.max_slots,
            voices=len(self.voices.list()),
        )

    def _build_and_start(self) -> EngineLike:
        if self._given_engine is not None:
            engine = self._given_engine
        else:
            assert self._engine_factory is not None
            log.info("engine_loading", variant=self.settings.variant, weights=self.settings.weights)
            engine = self._engine_factory(self.settings)
        if engine.random_weights:
            log.warning("random_weights", variant=engine.variant, message=RANDOM_WEIGHTS_WARNING)
        engine.start()  # idempotent
        while not engine.ready:
            if not engine.alive:
                raise RuntimeError("the engine thread died while warming up")
            time.sleep(ENGINE_READY_POLL_S)
        return engine

    async def _tick(self) -> None:
        period_s = self.settings.tick_s
        next_alive_check_s = 0.0
        while True:
            await asyncio.sleep(period_s)
            now_s = time.monotonic()
            for session in list(self.sessions):
                try:
                    session.tick(now_s)
                except Exception:  # one session's bug must not stop the ticker (and its watchdog) for all
                    log.exception("session_tick_failed", session_id=session.session_id)
                    self._end_session(session)
            if now_s >= next_alive_check_s:
                next_alive_check_s = now_s + ENGINE_ALIVE_CHECK_S
                self._check_engine()

    def _check_engine(self) -> None:
        engine = self.engine
        if engine is None or self.status != ServerStatus.READY or engine.alive:
            return
        self.status = ServerStatus.FAILED
        try:
            failure = engine.status().get("failure")
        except Exception:  # a dead engine may not even answer that
            failure = None
        self.detail = f"the engine thread died: {failure}" if failure else "the engine thread died"
        log.error("engine_died", failure=failure or "", sessions=len(self.sessions))
        for session in list(self.sessions):
            try:
                session.fail_streams("the engine stopped")
            except Exception:
                log.exception("session_fail_failed", session_id=session.session_id)
        self._report_failure()

    def _end_session(self, session: Session) -> None:
        try:
            session.close_now(1011, "internal error")
        except Exception:
            log.exception("session_close_failed", session_id=session.session_id)
            self.remove(session)

    def _report_failure(self) -> None:
        if self.on_engine_failed is not None:
            self.on_engine_failed(self.detail)


def _settle(future: asyncio.Future[EngineLike], result: EngineLike | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _default_segmenter_factory() -> SegmenterFactory:
    from agent_server.segmenter import Segmenter

    return Segmenter
