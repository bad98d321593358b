"""The port: what a protocol may use of the server, and nothing more.

A protocol (agent_server/protocols/) gets the session's verbs (core/session.py) and this port, as
`session.port`: the server's settings, its voices, the loaded models' facts and the router that picks the model of a
request (core/routing.py). It never gets the hub
(core/hub.py), which owns the engine, the sessions, the shared state and the lifecycle; a plain HTTP route
of a protocol (the vendors' voice and model listings) finds the port with `port_of(request)`.

Everything is read when asked: the settings the hub holds now, the model's facts once the engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from agent_server.core.routing import Router, RouteTable
from agent_server.core.voices import VoiceStore
from agent_server.settings import Settings
from synth.api import EngineLike, Variant


@dataclass(frozen=True, slots=True)
class ServingModel:
    """The facts of the models this server serves that a protocol may state."""

    variant: Variant  # the default model (a request that names none, in no language only another speaks)
    random_weights: bool | None  # None: not known until the engine is built
    max_slots: int  # every model's together
    models: tuple[Variant, ...]  # loaded, the default first

    @classmethod
    def of(cls, engine: EngineLike | None, settings: Settings) -> ServingModel:
        """The engine's facts once it is built, the configured ones before (the one place that chooses)."""
        if engine is None:
            return cls(settings.variant, None, sum(settings.max_slots.of(model) for model in settings.models),
                       settings.models)
        return cls(engine.variant, engine.random_weights, engine.max_slots, engine.models)


class Port:
    __slots__ = ("_model", "_routes", "_settings", "voices")

    def __init__(self, settings: Callable[[], Settings], voices: VoiceStore,
                 model: Callable[[], ServingModel], routes: Callable[[], RouteTable]) -> None:
        self._settings = settings
        self._model = model
        self._routes = routes
        self.voices = voices

    @property
    def settings(self) -> Settings:
        return self._settings()

    @property
    def model(self) -> ServingModel:
        return self._model()

    @property
    def router(self) -> Router:
        """The route table in force over the loaded models."""
        return Router(self._routes(), self._model().models)


def port_of(request: Request) -> Port:
    """The port of the app a plain HTTP route serves (`app.state.port`, set by agent_server/app.py)."""
    port: Port = request.app.state.port
    return port
