"""The port: what a protocol may use of the server, and nothing more.

A protocol (agent_server/protocols/) gets the session's verbs (core/session.py) and this port, as
`session.port`: the server's settings, its voices and the serving model's facts. It never gets the hub
(core/hub.py), which owns the engine, the sessions, the shared state and the lifecycle; a plain HTTP route
of a protocol (the vendors' voice and model listings) finds the port with `port_of(request)`.

Everything is read when asked: the settings the hub holds now, the model's facts once the engine is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from agent_server.core.voices import VoiceStore
from agent_server.settings import Settings
from synth.api import EngineLike, Variant


@dataclass(frozen=True, slots=True)
class ServingModel:
    """The facts of the model this server serves that a protocol may state."""

    variant: Variant
    random_weights: bool | None  # None: not known until the engine is built
    max_slots: int

    @classmethod
    def of(cls, engine: EngineLike | None, settings: Settings) -> ServingModel:
        """The engine's facts once it is built, the configured ones before (the one place that chooses)."""
        if engine is None:
            return cls(settings.variant, None, sum(settings.max_slots.of(model) for model in settings.models))
        return cls(engine.variant, engine.random_weights, engine.max_slots)


class Port:
    __slots__ = ("_model", "_settings", "voices")

    def __init__(self, settings: Callable[[], Settings], voices: VoiceStore,
                 model: Callable[[], ServingModel]) -> None:
        self._settings = settings
        self._model = model
        self.voices = voices

    @property
    def settings(self) -> Settings:
        return self._settings()

    @property
    def model(self) -> ServingModel:
        return self._model()


def port_of(request: Request) -> Port:
    """The port of the app a plain HTTP route serves (`app.state.port`, set by agent_server/app.py)."""
    port: Port = request.app.state.port
    return port
