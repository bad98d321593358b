"""Hub: the server's shared runtime, one per app (`app.state.hub`).

It owns the engine (built and warmed up on a daemon thread so /healthz answers while the model loads),
the voice store, the observers, the encoder pool (compressed output formats, off the event loop), the
registry of open sessions of every protocol, the ticker (segmenter polls and the slow-client watchdog) and
the shutdown drain; and, for running beside other replicas, the shared state (shared_state.py), the phrase
cache and its pre-warm list (phrase_cache.py) and the HAProxy agent check (agent_check.py).

Sessions (agent_server/core/session.py, one per WebSocket or HTTP request of any protocol) come in through
`await admit(session)` and leave through `remove(session)`; every context's stream comes from
`await open_stream(...)`. Admission and text charging are awaitable: the per-key limits they consult
live in the shared state (Redis with --redis-url).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import structlog

from agent_server.audio.codecs import StreamFormat
from agent_server.audio.encode_lane import EncoderPool
from agent_server.audio.formats import OutputFormat
from agent_server.core.events import (
    AudioOut,
    Emit,
    Stream,
    StreamDone,
    StreamEvent,
    StreamSpec,
    StreamStatus,
    build_params,
)
from agent_server.core.observers import Observers
from agent_server.core.outcomes import Outcome, Refusal
from agent_server.core.port import Port, ServingModel
from agent_server.core.routing import DEFAULT_ROUTES, MODEL_NOT_SERVED, load_routes
from agent_server.core.stream import SegmenterLike, SpeechStream
from agent_server.core.voices import Voice, VoiceStore
from agent_server.errors import UNAVAILABLE, FieldError
from agent_server.fleet.agent_check import AgentCheckServer, Capacity, ReplicaState
from agent_server.fleet.auth import AUTH_OFF_WARNING, Auth, Principal
from agent_server.fleet.phrase_cache import (
    MIB,
    NO_CACHE,
    PREWARM,
    CachedSource,
    CachePolicy,
    KeyContext,
    PhraseCache,
    Prewarm,
    PrewarmEntry,
    RedisTier,
    weights_identity,
)
from agent_server.fleet.shared_state import shared_state_from
from agent_server.settings import Settings
from synth.api import OUTPUT_SAMPLE_RATE_HZ, EngineConfigError, EngineLike, Variant

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
# what a pre-warm render is encoded to (nobody hears it)
PREWARM_FORMAT = StreamFormat.raw(OutputFormat("pcm_s16le", OUTPUT_SAMPLE_RATE_HZ))


class ServerStatus(enum.IntEnum):
    LOADING = 0  # building and warming up the engine
    READY = 1
    DRAINING = 2  # shutting down: no new sessions or contexts, in-flight speech may finish
    STOPPED = 3
    FAILED = 4  # the engine failed to load or its thread died


class SessionHandle(Protocol):
    """What the hub needs from a session of any protocol (session.Session)."""

    @property
    def session_id(self) -> str: ...
    @property
    def protocol_name(self) -> str: ...
    @property
    def principal(self) -> Principal | None: ...
    @property
    def live_streams(self) -> int: ...
    def tick(self, now_s: float) -> None: ...
    def begin_drain(self) -> None: ...
    def close_now(self, outcome: Outcome, reason: str) -> None: ...
    def fail_streams(self, detail: str) -> None: ...


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
        self.shared = shared_state_from(settings)  # in this process, or Redis with --redis-url
        self.auth = Auth.from_settings(settings, self.shared)  # raises AuthConfigError (a ValueError)
        self.observers = Observers()
        self.encoders = EncoderPool(settings.encoder_threads)  # threads start with the first compressed context
        self.voices = VoiceStore(
            settings.voices_dir, min_clip_s=settings.min_voice_clip_s, max_clip_s=settings.max_voice_clip_s,
            shared=self.shared,
        )
        cache_url = settings.cache_redis_url or settings.redis_url
        remote = (RedisTier(cache_url, prefix=settings.redis_prefix, ttl_s=settings.phrase_cache_ttl_s)
                  if cache_url else None)
        self.phrase_cache = PhraseCache(int(settings.phrase_cache_mb * MIB), remote)
        self.prewarm = Prewarm(settings.prewarm_file, self.phrase_cache)  # raises ValueError on an unusable list
        # which loaded model speaks a request (raises ValueError on an unusable --model-routes file)
        self.routes = load_routes(settings.model_routes) if settings.model_routes else DEFAULT_ROUTES
        self.weights_ids: dict[Variant, str] = {}  # each loaded model's weights_identity(), once the engine is built
        self.agent_check = (AgentCheckServer(settings.host, settings.agent_check_port, self.capacity)
                            if settings.agent_check_port else None)
        self._admitting = 0  # sessions between admit()'s first checks and their registration
        self._prewarm_numbers = itertools.count(1)
        self.status = ServerStatus.LOADING
        self.detail = "loading the model"
        self.engine: EngineLike | None = None  # set once built (it is ready once status is READY)
        self.sessions: set[SessionHandle] = set()
        self.make_segmenter = segmenter_factory or _default_segmenter_factory()
        self.port = Port(lambda: self.settings, self.voices, lambda: self.model,  # all a protocol gets
                         lambda: self.routes)
        self._given_engine = engine
        self._engine_factory = engine_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()  # lease releases, pre-warm reloads
        self._session_numbers = itertools.count(1)
        self._instance = secrets.token_hex(3)
        self._started_monotonic_s = time.monotonic()
        # Called once when the engine fails to load or its thread dies, after the sessions were failed.
        # The CLI sets it to shut the server down and exit non-zero, so that a supervisor restarts it
        # (a dead engine cannot be revived in-process); without it the server stays up, not ready.
        self.on_engine_failed: Callable[[str], None] | None = None
        # The engine refused its configuration (EngineConfigError: slots that do not fit the memory, with the
        # numbers): the CLI exits as for a bad flag (2), not as for a crash (70) a supervisor restarts.
        self.refused_config: str | None = None
        self._drained_complete = True  # the last drain ended every session within its grace period
        self._no_sessions = asyncio.Event()  # set while no session is registered
        self._no_sessions.set()
        self.engine_settled = asyncio.Event()  # set once the engine is loaded, or failed to load
        self.became_ready = asyncio.Event()  # set once the server serves (the pre-warm list rendered)
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drain_hook_tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.shared.start()
        self.auth.announce()  # (after the shared state's first read: its keys may turn auth on)
        if self.agent_check is not None:
            await self.agent_check.start()
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
        await asyncio.gather(*list(self._background), return_exceptions=True)  # lease releases among them
        if self.agent_check is not None:
            await self.agent_check.stop()
        await self.voices.detach()
        await self.phrase_cache.close()
        await self.shared.stop()
        engine = self.engine or self._given_engine
        if engine is not None and engine.alive:
            await asyncio.to_thread(engine.stop)
        await asyncio.to_thread(self.encoders.shutdown)
        log.info("server_stopped")

    async def drain(self, grace_s: float, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Stop taking work, let in-flight speech finish for up to `grace_s` (or until `give_up()`),
        then close what is left with 1001. True when every session ended within the grace period."""
        if self.status >= ServerStatus.DRAINING and not self.sessions:
            return self._drained_complete
        if self.status < ServerStatus.DRAINING:
            self.status = ServerStatus.DRAINING
            self.detail = "shutting down"
            self._drain_hook_tasks = [asyncio.create_task(_logged(hook(), "drain_hook")) for hook in self._drain_hooks]
        log.info("drain_started", sessions=len(self.sessions), grace_s=grace_s)
        for session in list(self.sessions):
            session.begin_drain()
        deadline_s = time.monotonic() + grace_s
        while self.sessions and time.monotonic() < deadline_s and not give_up():
            await self._until_no_sessions(min(DRAIN_POLL_S, deadline_s - time.monotonic()))
        self._drained_complete = not self.sessions
        if self.sessions:
            log.warning("drain_deadline", sessions=len(self.sessions))
            for session in list(self.sessions):
                session.close_now(Outcome.DRAIN_CUT, "server shutting down")
            await self._until_no_sessions(self.settings.close_timeout_s + 1.0)
        await asyncio.gather(*self._drain_hook_tasks)
        log.info("drain_done", sessions_left=len(self.sessions), complete=self._drained_complete)
        return self._drained_complete

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run `hook()` when the drain begins, beside the sessions' drain; the drain returns once it is done too
        (the job runner stops there, handing its claims back: agent_server/jobs/service.py)."""
        self._drain_hooks.append(hook)

    async def _until_no_sessions(self, timeout_s: float) -> None:
        """Return when the last session is gone, or after `timeout_s`."""
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._no_sessions.wait()
        except TimeoutError:
            pass

    # ---- sessions ------------------------------------------------------------------------------

    def new_session_id(self) -> str:
        return f"{self._instance}-{next(self._session_numbers)}"

    async def admit(self, session: SessionHandle) -> Refusal | None:
        """Register a session, or say why not (the session then answers busy in its protocol's form and ends
        with the refusal's outcome: 1013, or 429/503 over HTTP). Nothing is registered when it refuses. The key's
        session lease (fleet/auth.py, in the shared state) is taken here and given back by `remove`."""
        if self.status != ServerStatus.READY:
            return Refusal(self._not_serving_reason(), Outcome.NOT_READY)
        if len(self.sessions) + self._admitting >= self.settings.max_sessions:
            return Refusal(f"too many sessions (at most {self.settings.max_sessions})", Outcome.BUSY)
        self._admitting += 1  # counted while the key's limit is read (Redis): the place is taken
        try:
            refusal = await self.auth.acquire_session(session.principal, session.session_id)
        finally:
            self._admitting -= 1
        if refusal is not None:
            return Refusal(refusal, Outcome.BUSY)
        if not self.ready:  # the drain may have begun while the key's limit was read
            self.spawn(self.auth.release_session(session.principal, session.session_id), "release_session")
            return Refusal(self._not_serving_reason(), Outcome.NOT_READY)
        self.sessions.add(session)
        self._no_sessions.clear()
        return None

    def remove(self, session: SessionHandle) -> None:
        """Unregister a session at once; its key's lease is given back in the background (a lease that
        cannot be given back now, Redis being down, expires on its own)."""
        if session in self.sessions:
            self.sessions.discard(session)
            self.spawn(self.auth.release_session(session.principal, session.session_id), "release_session")
            if not self.sessions:
                self._no_sessions.set()

    async def charge_text(self, principal: Principal | None, chars: int) -> str | None:
        """Count text against the API key's per-minute budget; a refusal reason when it is spent."""
        return await self.auth.charge_text(principal, chars)

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> None:
        """Run `coro` in the background, kept referenced until done; a failure is logged."""
        task = asyncio.get_running_loop().create_task(coro, name=what)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background_task_failed", task=task.get_name(), error=repr(task.exception()))

    def _not_serving_reason(self) -> str:
        return {
            ServerStatus.LOADING: "starting: the model is loading",
            ServerStatus.READY: "ready",
            ServerStatus.DRAINING: "shutting down",
            ServerStatus.STOPPED: "shutting down",
            ServerStatus.FAILED: "the engine failed",
        }[self.status]

    async def open_stream(self, key: str, spec: StreamSpec, emit: Emit) -> Stream:
        """A stream for one context (not opened yet: call `.open()`): a SpeechStream whose segments come
        from the phrase cache when it has them, else from the engine (`stream_source`); its voice is leased
        until its StreamDone. Every protocol, WebSocket or HTTP, gets its streams here, so this is where the
        drain is checked and where the cache plugs in. Raises FieldError (`busy` when the server is not
        serving; a VoiceError, which is one, for a voice it cannot use)."""
        engine = self.engine
        if engine is None or not self.ready:
            raise FieldError("", f"the server is not ready: {self._not_serving_reason()}", UNAVAILABLE, busy=True)
        if spec.model is None:
            spec = dataclasses.replace(spec, model=engine.variant)
        elif spec.model not in engine.models:  # (the router picks loaded models only)
            raise FieldError("model", f"this server does not run {spec.model!r}", MODEL_NOT_SERVED)
        voice = self.voices.acquire(spec.voice_id)

        def emit_then_release(stream: Stream, event: StreamEvent) -> None:
            emit(stream, event)
            if isinstance(event, StreamDone):
                self.voices.release(voice)

        source = self.stream_source(engine, voice, spec.language, CachePolicy() if spec.cache else NO_CACHE,
                                    model=spec.model)
        return SpeechStream(key, spec, engine=source, segmenter=self.make_segmenter(), post=self.post,
                            emit=emit_then_release, encoder_pool=self.encoders)

    def stream_source(self, engine: EngineLike, voice: Voice, language: str | None, policy: CachePolicy,
                      *, model: Variant | None = None, pin: bool = False) -> CachedSource:
        """Where a stream's segments (and a job's: jobs/render.py) get their audio: the phrase cache, else the
        engine (phrase_cache.py). `model`: the serving model (None: the engine's default)."""
        model = model or engine.variant
        context = KeyContext(model, self.weights_ids[model], voice.voice_id, voice.version_of(model), language)
        return CachedSource(engine, self.phrase_cache, context, policy, self.post, pin=pin)

    # ---- the pre-warm list ---------------------------------------------------------------------

    async def speak_prewarm(self, entry: PrewarmEntry) -> tuple[list[str], bool]:
        """Render one pre-warm phrase into the phrase cache (pinned): (the keys it is stored under, whether
        every segment was a cache hit already). Raises ValueError (a FieldError among them) on an unusable
        entry, RuntimeError when it did not complete."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("no engine")
        routed = self.port.router.route(model_field="model", model=entry.model, language_field="language",
                                        language=entry.language)
        params = build_params(routed.model, entry.sampling, entry.seed)
        spec = StreamSpec(voice_id=entry.voice_id, params=params, output_format=PREWARM_FORMAT,
                          language=routed.language, model=routed.model)
        voice = self.voices.acquire(entry.voice_id)
        done: asyncio.Future[StreamDone] = asyncio.get_running_loop().create_future()

        def emit(stream: Stream, event: StreamEvent) -> None:
            if isinstance(event, AudioOut):
                stream.on_frame_sent(time.monotonic(), event.duration_ms)  # nobody listens: never hold one back
            elif isinstance(event, StreamDone) and not done.done():
                done.set_result(event)

        try:
            source = self.stream_source(engine, voice, spec.language, PREWARM, model=spec.model, pin=True)
            stream = SpeechStream(f"prewarm/{next(self._prewarm_numbers)}", spec, engine=source,
                                  segmenter=self.make_segmenter(), post=self.post, emit=emit)
            stream.open()
            now_s = time.monotonic()
            stream.push_text(entry.text, now_s)
            stream.end(now_s)
            outcome = await done
        finally:
            self.voices.release(voice)
        if outcome.status != StreamStatus.COMPLETED:
            raise RuntimeError(f"{outcome.reason}: {outcome.detail}")
        return source.stored_keys, source.hits == stream.segment_count

    def reload_prewarm(self) -> None:
        """Read the pre-warm list again and render what is new, in the background (SIGHUP, cli.py)."""
        if self.prewarm.running or not self.ready:
            log.warning("prewarm_reload_skipped", running=self.prewarm.running, status=self.status.name.lower())
            return
        self.spawn(self.prewarm.reload(self.speak_prewarm), "prewarm_reload")

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the event loop; callable from any thread (the engine's sinks use it)."""
        if self._loop is None:
            raise RuntimeError("the hub is not started")
        self._loop.call_soon_threadsafe(fn, *args)

    @property
    def model(self) -> ServingModel:
        return ServingModel.of(self.engine, self.settings)

    @property
    def ready(self) -> bool:
        return self.status == ServerStatus.READY

    @property
    def alive(self) -> bool:
        return self.status != ServerStatus.FAILED

    def status_json(self) -> dict[str, Any]:
        engine = self.engine
        engine_status: dict[str, Any] = engine.status() if engine is not None else {}
        model = self.model
        warnings = [RANDOM_WEIGHTS_WARNING] if model.random_weights else []
        if not self.auth.enabled:
            warnings.append(AUTH_OFF_WARNING)
        return {
            "status": self.status.name.lower(),
            "detail": self.detail,
            "ready": self.ready,
            "variant": model.variant,
            "models": self._models_json(engine_status),
            "routes": self.routes.to_json(),
            "random_weights": model.random_weights,
            "weights": str(self.settings.weights),
            "weights_source": engine_status.get("weights_source"),
            "engine": engine_status,
            "sessions": len(self.sessions),
            "contexts": sum(s.live_streams for s in self.sessions),
            "max_sessions": self.settings.max_sessions,
            "uptime_s": round(time.monotonic() - self._started_monotonic_s, 3),
            "auth": self.auth.status_json(),
            "shared_state": self.shared.status_json(),
            "phrase_cache": self.phrase_cache.status_json(),
            "prewarm": self.prewarm.status_json(),
            "warnings": warnings,
        }

    def _models_json(self, engine_status: dict[str, Any]) -> dict[str, Any]:
        """Each loaded model (the default first): the engine's own entry for it, its slots, its weights identity."""
        per_model = engine_status.get("models")
        out: dict[str, Any] = {}
        for name in self.model.models:
            own = per_model.get(name) if isinstance(per_model, dict) else None
            entry: dict[str, Any] = dict(own) if isinstance(own, dict) else {}
            entry.setdefault("max_slots", self.engine.max_slots_of(name) if self.engine is not None
                             else self.settings.max_slots.of(name))
            entry["default"] = name == self.model.variant
            entry["weights"] = self.settings.weights.of(name)
            entry["weights_id"] = self.weights_ids.get(name)
            out[name] = entry
        return out

    def capacity(self) -> Capacity:
        """What the HAProxy agent check reports (agent_check.py)."""
        engine = self.engine
        engine_status: dict[str, Any] = engine.status() if engine is not None and self.ready else {}
        state = {
            ServerStatus.LOADING: ReplicaState.LOADING,
            ServerStatus.READY: ReplicaState.READY,
            ServerStatus.DRAINING: ReplicaState.DRAINING,
            ServerStatus.STOPPED: ReplicaState.DRAINING,
            ServerStatus.FAILED: ReplicaState.FAILED,
        }[self.status]
        return Capacity(state, len(self.sessions), self.settings.max_sessions,
                        int(engine_status.get("slots_in_use", 0)), int(engine_status.get("waiting", 0)),
                        self.model.max_slots, self.detail)

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
            self.weights_ids = await asyncio.to_thread(_weights_ids, engine)
            await self.voices.attach(engine, self.weights_ids)
        except Exception as exc:
            self.status = ServerStatus.FAILED
            self.detail = f"engine failed to load: {exc}"
            if isinstance(exc, EngineConfigError):  # (slots that do not fit, models not loaded): no restart fixes it
                self.refused_config = str(exc)
            log.exception("engine_load_failed")
            self.engine_settled.set()
            self._report_failure()
            return
        self.engine_settled.set()
        if self.prewarm.entries and self.status == ServerStatus.LOADING:
            self.detail = f"pre-warming {len(self.prewarm.entries)} phrases"
            await self.prewarm.run(self.speak_prewarm)
        if self.status == ServerStatus.LOADING:
            self.status = ServerStatus.READY
            self.detail = "ready"
            self.became_ready.set()
        log.info(
            "server_ready",
            model=engine.variant,
            models=",".join(engine.models),
            random_weights=engine.random_weights,
            max_slots=engine.max_slots,
            max_slots_per_model={model: engine.max_slots_of(model) for model in engine.models},
            voices=len(self.voices.list()),
            routes=self.routes.source,
        )

    def _build_and_start(self) -> EngineLike:
        if self._given_engine is not None:
            engine = self._given_engine
        else:
            if self._engine_factory is None:
                raise RuntimeError("no engine and no engine factory")
            log.info("engine_loading", models=",".join(self.settings.models), weights=str(self.settings.weights))
            engine = self._engine_factory(self.settings)
        if engine.models != self.settings.models and self._given_engine is None:
            raise EngineConfigError(f"--variant {','.join(self.settings.models)} asks for these models, the engine "
                                    f"loaded {','.join(engine.models)}")
        if engine.random_weights:
            log.warning("random_weights", model=",".join(engine.models), message=RANDOM_WEIGHTS_WARNING)
        engine.start()  # idempotent
        while not engine.ready:
            if not engine.alive:
                failure = engine.status().get("failure") or "no reason given"
                raise RuntimeError(f"the engine thread died while warming up: {failure}")
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

    def _end_session(self, session: SessionHandle) -> None:
        try:
            session.close_now(Outcome.INTERNAL_ERROR, "internal error")
        except Exception:
            log.exception("session_close_failed", session_id=session.session_id)
            self.remove(session)

    def _report_failure(self) -> None:
        if self.on_engine_failed is not None:
            self.on_engine_failed(self.detail)


def _weights_ids(engine: EngineLike) -> dict[Variant, str]:
    """Each loaded model's weights identity (its own entry of the engine's status where it has one)."""
    status = engine.status()
    per_model = status.get("models")
    ids = {}
    for model in engine.models:
        own = per_model.get(model) if isinstance(per_model, dict) else None
        ids[model] = weights_identity({**status, **own} if isinstance(own, dict) else status, model)
    return ids


async def _logged(work: Awaitable[None], what: str) -> None:
    """Await `work`; a failure is logged, never raised (a drain goes on whatever one hook does)."""
    try:
        await work
    except Exception:
        log.exception(f"{what}_failed")


def _settle(future: asyncio.Future[EngineLike], result: EngineLike | BaseException) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _default_segmenter_factory() -> SegmenterFactory:
    from agent_server.text.segmenter import Segmenter

    return Segmenter
