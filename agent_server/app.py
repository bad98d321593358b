"""The Starlette application: routes and a lifespan that loads the engine without blocking the loop.

    app = create_app(engine)              # an EngineLike instance (tests: FakeEngine); started here
    app = create_app(factory, settings)   # Settings -> EngineLike, called on a loader thread
    app = create_app(settings=settings)   # settings.engine_factory, else synth.build_engine (lazy import)

/healthz answers from the first moment; /readyz turns 200 once the model is loaded, warmed up and the
stored voices are back. With `Settings.grpc_port`, the lifespan also serves NVIDIA Riva's TTS gRPC API
(agent_server/core/grpc_server.py): its calls are sessions of the same hub. Jobs (`/v1/jobs`,
agent_server/jobs/service.py) start rendering once the server is ready and stop when the drain begins, before the
engine stops.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp
from starlette.websockets import WebSocket

from agent_server import metrics, protocols
from agent_server.core import voices
from agent_server.core.hub import EngineFactory, Hub, SegmenterFactory
from agent_server.core.session import websocket_route
from agent_server.core.transport import SocketControlMiddleware
from agent_server.fleet.auth import REVOKE_PATH, TOKEN_PATH, AuthMiddleware, issue_token, revoke_token
from agent_server.jobs.service import JobsConfig, JobService
from agent_server.protocols.native import NativeProtocol
from agent_server.settings import Settings
from synth.api import EngineLike

if TYPE_CHECKING:
    from agent_server.core.grpc_server import GrpcServer

NATIVE_PATH = "/v1/stream"


def create_app(
    engine: EngineLike | EngineFactory | None = None,
    settings: Settings | None = None,
    *,
    segmenter_factory: SegmenterFactory | None = None,
    jobs_config: JobsConfig | None = None,
) -> Starlette:
    """`jobs_config`: the jobs' settings (tests), else the ones `settings` gives."""
    settings = settings or Settings()
    if engine is None:
        hub = Hub(settings, engine_factory=default_engine_factory, segmenter_factory=segmenter_factory)
    elif isinstance(engine, EngineLike):
        hub = Hub(settings, engine=engine, segmenter_factory=segmenter_factory)
    else:
        hub = Hub(settings, engine_factory=engine, segmenter_factory=segmenter_factory)

    jobs = JobService(hub, jobs_config or JobsConfig.from_settings(settings))  # ValueError: a bad --webhook-allow

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await hub.start()
        await jobs.start()  # its runner waits for the server to be ready
        grpc_server = await start_grpc(hub, settings) if settings.grpc_port else None
        app.state.grpc = grpc_server
        try:
            yield
        finally:
            await hub.drain(settings.shutdown_grace_s)  # at once when the server already drained; jobs stop first
            if grpc_server is not None:
                await grpc_server.stop()
            await jobs.stop()
            await hub.stop()

    routes: list[BaseRoute] = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/v1/status", status, methods=["GET"]),
        Route(TOKEN_PATH, issue_token, methods=["POST"]),
        Route(REVOKE_PATH, revoke_token, methods=["POST"]),
        websocket_route(NATIVE_PATH, NativeProtocol),
        *voices.routes,
        *jobs.routes(),  # /v1/jobs: long texts behind 202 Accepted
        *protocols.routes(),  # ElevenLabs, Cartesia, Deepgram, OpenAI drop-in endpoints
        *metrics.routes(),  # /, /dashboard, /dashboard/stream, /metrics, /static
    ]
    # every route but the probes and static pages; a refusal in the shape of the vendor whose path was asked for
    middleware = [Middleware(AuthMiddleware, auth=hub.auth, refusal=protocols.refusal_response)]
    app = App(routes=routes, lifespan=lifespan, middleware=middleware)
    app.send_buffer_bytes = settings.socket_send_buffer_bytes
    app.state.hub = hub
    app.state.jobs = jobs
    app.state.port = hub.port  # what the protocols' plain HTTP routes may use (core/port.py)
    app.state.observers = hub.observers  # metrics subscribe here: observers.subscribe(fn)
    metrics.install(app)
    return app


class App(Starlette):
    """Starlette with `SocketControlMiddleware` outside everything, where it sees the server's own `send`."""

    send_buffer_bytes = 0

    def build_middleware_stack(self) -> ASGIApp:
        return SocketControlMiddleware(super().build_middleware_stack(), send_buffer_bytes=self.send_buffer_bytes)


async def start_grpc(hub: Hub, settings: Settings) -> GrpcServer:
    """The gRPC server (imported only when a port is set: it loads grpcio and the Riva protos)."""
    from agent_server.core.grpc_server import GrpcCalls, GrpcServer
    from agent_server.protocols import riva_service

    server = GrpcServer(settings, lambda grpc_server: riva_service.add_to_server(grpc_server, GrpcCalls(hub)))
    await server.start()
    return server


def default_engine_factory(settings: Settings) -> EngineLike:
    """settings.engine_factory ("module:callable") if set, else the real engine (imported only now)."""
    if settings.engine_factory:
        module_name, _, attr = settings.engine_factory.partition(":")
        factory: EngineFactory = getattr(importlib.import_module(module_name), attr)
        return factory(settings)
    from synth import build_engine

    engine: EngineLike = build_engine(settings.engine_config())
    return engine


def _hub(request: Request | WebSocket) -> Hub:
    hub: Hub = request.app.state.hub
    return hub


async def healthz(request: Request) -> Response:
    """Liveness: the process serves; 503 once the engine failed (restart me)."""
    hub = _hub(request)
    body = {"status": hub.status.name.lower(), "detail": hub.detail}
    return JSONResponse(body, status_code=200 if hub.alive else 503)


async def readyz(request: Request) -> Response:
    """Readiness: the model is loaded and warmed up (the pre-warm list rendered) and the server is not
    shutting down. A shared state that is down does not make it unready (it serves what needs none), but
    says so in `detail` and `shared_state`."""
    hub = _hub(request)
    shared = hub.shared
    detail = hub.detail
    if hub.ready and not shared.available:
        detail = f"{detail}; degraded: shared state unavailable ({shared.detail})"
    body = {"status": hub.status.name.lower(), "detail": detail,
            "shared_state": {"backend": "redis" if shared.shared else "local", "available": shared.available}}
    return JSONResponse(body, status_code=200 if hub.ready else 503)


async def status(request: Request) -> Response:
    jobs: JobService = request.app.state.jobs
    return JSONResponse({**_hub(request).status_json(), "jobs": jobs.status_json()})

