"""`agent-server`: parse flags (each with an environment variable), configure logging, run uvicorn.

SIGTERM / Ctrl-C: stop accepting connections, let in-flight speech finish for --shutdown-grace-s, close
the remaining sessions with 1001, then stop the engine. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import uvicorn

from agent_server import metrics
from agent_server.app import create_app
from agent_server.hub import Hub
from agent_server.logging import configure_logging
from agent_server.settings import DTYPES, ENV_VARS, LOG_LEVELS, Settings
from synth.api import VARIANTS

UVICORN_GRACEFUL_TIMEOUT_S = 5.0  # after our own drain, for whatever uvicorn still waits on
GIL_SWITCH_INTERVAL_S = 0.001
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-server",
        description="Real-time voice-agent TTS server (Chatterbox). Every flag can also be set by the "
        "environment variable shown; flags win.",
    )

    def add(flag: str, name: str, help_text: str, **kwargs: Any) -> None:
        env = " or ".join(f"${v}" for v in ENV_VARS[name])
        default = getattr(Settings(), name)
        parser.add_argument(flag, dest=name, default=None, help=f"{help_text} (env {env}; default {default})", **kwargs)

    add("--host", "host", "interface to listen on")
    add("--port", "port", "TCP port", type=int)
    add("--variant", "variant", "model variant", choices=VARIANTS)
    add(
        "--weights",
        "weights",
        "auto (a local checkpoint, else the hub, else random weights with a warning), random-tiny, "
        "random-full, or a checkpoint directory",
    )
    add("--device", "device", "auto, cpu, cuda, cuda:N")
    add("--dtype", "dtype", "T3 weights dtype", choices=DTYPES)
    add("--max-sessions", "max_sessions", "open WebSocket sessions at most", type=int)
    add("--max-slots", "max_slots", "segments the engine generates at once", type=int)
    add(
        "--queue-when-full",
        "queue_when_full",
        "when every slot is taken, queue a new context's first segment instead of answering busy",
        action="store_const",
        const=True,
    )
    add("--tls-cert", "tls_certfile", "TLS certificate (PEM); serves wss:// and https:// with --tls-key")
    add("--tls-key", "tls_keyfile", "TLS private key (PEM)")
    add("--log-level", "log_level", "log level", choices=LOG_LEVELS)
    add("--data-dir", "data_dir", "where uploaded voices are kept")
    add("--metrics-port", "metrics_port", "also serve /metrics and /dashboard on this port (0: off)", type=int)
    add("--shutdown-grace-s", "shutdown_grace_s", "on SIGTERM, how long in-flight speech may finish", type=float)
    add("--engine-factory", "engine_factory", "module:callable building the engine (tests and development)")
    return parser


def settings_from(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Settings:
    """Defaults < environment < flags. Raises SystemExit (via argparse) on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, env_names in ENV_VARS.items():
        value = getattr(args, name)
        if value is None:
            raw = next((environ[e] for e in env_names if environ.get(e)), None)
            if raw is None:
                continue
            value = _convert(name, raw, fields[name].type, parser)
        values[name] = Path(value) if name == "data_dir" else value
    try:
        return Settings(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _convert(name: str, raw: str, annotation: object, parser: argparse.ArgumentParser) -> Any:
    kind = str(annotation)
    if kind == "bool":
        if raw.lower() not in BOOL_WORDS:
            parser.error(f"{'/'.join(ENV_VARS[name])}={raw!r}: not one of {', '.join(BOOL_WORDS)}")
        return BOOL_WORDS[raw.lower()]
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        parser.error(f"{'/'.join(ENV_VARS[name])}={raw!r}: not a number")
    return raw


class GracefulServer(uvicorn.Server):
    """uvicorn closes WebSockets with 1012 at once on shutdown; we first drain (see Hub.drain)."""

    def __init__(self, config: uvicorn.Config, hub: Hub, grace_s: float) -> None:
        super().__init__(config)
        self.hub = hub
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.hub.drain(self.grace_s, give_up=lambda: self.force_exit)
        await super().shutdown(sockets=sockets)


def build_server(app: Any, settings: Settings, **config_overrides: Any) -> GracefulServer:
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
        log_config=None,  # logging.configure_logging owns the handlers
        log_level=settings.log_level,
        ws="websockets-sansio",
        ws_max_size=settings.max_message_bytes,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        ws_per_message_deflate=False,  # audio does not compress; save the CPU
        lifespan="on",
        timeout_graceful_shutdown=UVICORN_GRACEFUL_TIMEOUT_S,
        **config_overrides,
    )
    return GracefulServer(config, app.state.hub, settings.shutdown_grace_s)


def main(argv: Sequence[str] | None = None) -> None:
    settings = settings_from(argv, os.environ)
    configure_logging(settings.log_level)
    # The event loop shares the GIL with the engine thread; by default a thread holding it keeps it for
    # 5 ms, which would show up in every first frame's latency. 1 ms bounds that wait.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    app = create_app(settings=settings)
    metrics_server = None
    if settings.metrics_port:
        metrics_server, metrics_thread = metrics.serve_in_thread(app, settings.host, settings.metrics_port,
                                                                 log_level=settings.log_level)
    try:
        build_server(app, settings).run()
    finally:
        if metrics_server is not None:
            metrics_server.should_exit = True
            metrics_thread.join(5)


if __name__ == "__main__":
    main()
