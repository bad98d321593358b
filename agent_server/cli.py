"""`agent-server`: parse flags (each with an environment variable), configure logging, run uvicorn.

SIGTERM / Ctrl-C: stop accepting connections, let in-flight speech finish for --shutdown-grace-s, close
the remaining sessions with 1001, then stop the engine. A second signal skips the wait. The exit status
says how it went: 0 when every session ended within the grace period, EXIT_DRAIN_CUT (75) when the grace
ran out (or a second signal cut it short) and sessions were closed under their speech.

The engine failing (to load, or its thread dying) fails every context with `engine_failed`, closes the
sessions with 1001, and exits with EXIT_ENGINE_FAILED so that a supervisor restarts the process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import structlog
import uvicorn

from agent_server import metrics
from agent_server.app import create_app
from agent_server.core.hub import Hub
from agent_server.logging import configure_logging
from agent_server.settings import Group, Setting, Settings, SettingsError, number, optional_path, path, table, whole

UVICORN_GRACEFUL_TIMEOUT_S = 5  # after our own drain, for whatever uvicorn still waits on
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine died; a supervisor should restart the process
EXIT_DRAIN_CUT = 75  # EX_TEMPFAIL: shut down, but the grace period ran out with sessions still speaking
# uvicorn's WebSocket implementation: wsproto passes the Autobahn core cases (tests/agent_server/
# test_autobahn.py); "websockets-sansio" answers case 7.1.5 (a close inside a fragmented message) with 1002.
WS_IMPLEMENTATION = "wsproto"
ENGINE_FAILED_GRACE_S = 2.0  # after an engine failure: time for the sessions' error messages to go out
GIL_SWITCH_INTERVAL_S = 0.001


def build_parser() -> argparse.ArgumentParser:
    """The command line, generated from the settings' table (agent_server/settings.py), one section per group."""
    parser = argparse.ArgumentParser(
        prog="agent-server",
        usage="agent-server [--flag value ...]",
        description="Real-time voice-agent TTS server (Chatterbox). Every flag can also be set by the environment\n"
        "variable shown; flags win.",
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=34, width=110),
    )
    defaults = Settings()
    sections = {group: parser.add_argument_group(group.value) for group in Group}
    environment_only = []
    for name, row in table():
        env = " or ".join(f"${v}" for v in row.env)
        if row.flag is None:
            environment_only.append(f"  {env}: {row.help}")
            continue
        help_text = f"{row.help} (env {env}; default {_shown(getattr(defaults, name))})"
        if row.is_switch:
            sections[row.group].add_argument(row.flag, dest=name, default=None, help=help_text, action="store_const",
                                             const=True)
        else:
            metavar = row.metavar or ("{" + ",".join(row.choices) + "}" if row.choices else _metavar(name, row))
            sections[row.group].add_argument(row.flag, dest=name, default=None, help=help_text, metavar=metavar,
                                             type=_flag_reader(row))
    parser.epilog = "environment only (a secret on a command line shows in `ps`):\n" + "\n".join(environment_only)
    return parser


def _shown(default: object) -> str:
    if default is None or default == ():
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(str(item) for item in default)
    return str(default)


def _metavar(name: str, row: Setting) -> str:
    if name.endswith("_s"):
        return "SECONDS"
    if name.endswith("port"):
        return "PORT"
    if name.endswith("_url"):
        return "URL"
    if row.read in (whole, number):
        return "MIB" if name.endswith("_mb") else "N"
    if row.read in (path, optional_path) or name.endswith("file"):
        return "PATH"
    return name.upper()


def _flag_reader(row: Setting) -> Callable[[str], Any]:
    """The row's reader, its refusal in argparse's form ("argument --port: 'x': not a whole number")."""

    def read(raw: str) -> Any:
        try:
            return row.read(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{raw!r}: {exc}") from None

    read.__name__ = row.flag or "value"
    return read


def settings_from(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Settings:
    """Defaults < environment < flags. Raises SystemExit (via argparse) on a bad value, naming the flag or the
    variable it came from."""
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    source: dict[str, str] = {}  # setting -> the flag or variable its value came from
    for name, row in table():
        value = getattr(args, name, None)  # (a setting without a flag has no attribute)
        if value is not None:
            values[name], source[name] = value, row.flag or name
            continue
        env = next((e for e in row.env if environ.get(e)), None)
        if env is None:
            continue
        try:
            values[name], source[name] = row.read(environ[env]), f"${env}"
        except ValueError as exc:
            parser.error(f"${env}={environ[env]!r}: {exc}")
    try:
        return Settings(**values)
    except SettingsError as exc:
        parser.error(exc.render(lambda name: source.get(name) or flag_of(name)))
        raise  # unreachable: parser.error exits


def flag_of(name: str) -> str:
    """What an operator sets a setting with: its flag, else its first variable."""
    row = dict(table()).get(name)
    if row is None:
        return name
    return row.flag or f"${row.env[0]}"


class GracefulServer(uvicorn.Server):
    """uvicorn closes WebSockets with 1012 at once on shutdown; we first drain (see Hub.drain). And
    uvicorn re-raises the signal it caught once it has shut down (the process then dies of SIGTERM,
    status 143, which supervisors read as a failure); we exit with a status of our own instead
    (`exit_status`)."""

    def __init__(self, config: uvicorn.Config, hub: Hub, grace_s: float) -> None:
        super().__init__(config)
        self.hub = hub
        self.grace_s = grace_s
        self.drained: bool | None = None  # None: no shutdown yet; then whether the drain was complete

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting
            server.close()
        for sock in sockets or []:
            sock.close()
        self.drained = await self.hub.drain(self.grace_s, give_up=lambda: self.force_exit)
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A second signal skips the drain's wait: SIGTERM as well (uvicorn: a second SIGINT only), as a
        supervisor or `kill` sends it."""
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # shut down on purpose: `main` exits with its own status

    @property
    def exit_status(self) -> int:
        return 0 if self.drained is not False else EXIT_DRAIN_CUT


def handshake_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with a deadline on each request head (a WebSocket handshake
    included): a connection that opens and then sends nothing, or dribbles its headers (slowloris), is
    closed `timeout_s` after it opened (or after its previous response). uvicorn has none: its
    keep-alive timeout only runs between requests. None without httptools (then use a proxy's
    client_header_timeout, see docs/operations.md)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
        return None

    class HandshakeDeadlineProtocol(HttpToolsProtocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_head_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_deadline is None:
                self._head_deadline = self.loop.call_later(timeout_s, self._head_timed_out)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_timed_out(self) -> None:
            self._head_deadline = None
            if not self.transport.is_closing():
                client = f"{self.client[0]}:{self.client[1]}" if self.client else ""
                structlog.get_logger("agent_server.cli").info("handshake_timeout", client=client, timeout_s=timeout_s)
                self.transport.close()

    return HandshakeDeadlineProtocol


def build_server(app: Any, settings: Settings, **config_overrides: Any) -> GracefulServer:
    if settings.handshake_timeout_s > 0 and "http" not in config_overrides:
        protocol = handshake_deadline_protocol(settings.handshake_timeout_s)
        if protocol is not None:
            config_overrides["http"] = protocol
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ssl_certfile=settings.tls_certfile,
        ssl_keyfile=settings.tls_keyfile,
        log_config=None,  # logging.configure_logging owns the handlers
        log_level=settings.log_level,
        ws=WS_IMPLEMENTATION,
        ws_max_size=settings.max_message_bytes,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        ws_per_message_deflate=False,  # audio does not compress; save the CPU
        lifespan="on",
        timeout_graceful_shutdown=UVICORN_GRACEFUL_TIMEOUT_S,
        **config_overrides,
    )
    if config.is_ssl:
        config.load()  # what `serve` does first; the TLS context exists from here on
        assert config.ssl is not None
        # No TLS 1.3 session tickets. They arrive after the handshake, so a client whose reader thread
        # takes them in while its main thread writes the upgrade request runs two OpenSSL calls on one SSL
        # object at once, and the request can be lost: the websockets sync client (the ElevenLabs SDK's) on
        # CPython 3.11 timed out in 4 of 3,000 wss:// connects on two busy cores, a client that reads from
        # the start in 8 of 200 (scripts/tls_ticket_race.py; none of either without tickets). Resumption
        # would save a round trip per connect; our connections last a conversation.
        config.ssl.num_tickets = 0
    return GracefulServer(config, app.state.hub, settings.shutdown_grace_s)


def _bind_problem(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on now (taken, not allowed), or None (0: off)."""
    if not port:
        return None
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _tls_problem(certfile: str | None, keyfile: str | None) -> str | None:
    """Why the certificate and key cannot serve TLS (a file missing or unreadable, not PEM, not a pair)."""
    if certfile is None or keyfile is None:
        return None
    for flag, file in (("--tls-cert", certfile), ("--tls-key", keyfile)):
        try:
            with open(file, "rb"):
                pass
        except OSError as exc:
            return f"{flag} {file}: {exc.strerror or exc}"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError, ValueError) as exc:
        return f"--tls-cert {certfile} / --tls-key {keyfile}: not a PEM certificate and its private key ({exc})"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    settings = settings_from(argv, os.environ)
    configure_logging(settings.log_level)
    from synth.loading import config_problem  # here: chatterbox's import warns, now into the JSON log

    engine_config = settings.engine_config()
    problem = config_problem(engine_config)
    if problem is not None:  # before the port opens: no restart would fix it
        build_parser().error(problem)
    metrics_host = settings.metrics_host or settings.host
    ports = (("--port", settings.host, settings.port), ("--grpc-port", settings.host, settings.grpc_port),
             ("--agent-check-port", settings.host, settings.agent_check_port),
             ("--metrics-port", metrics_host, settings.metrics_port))
    for flag, host, port in ports:  # before the model loads: later, a taken port is a traceback (or exit 3)
        taken = _bind_problem(host, port)
        if taken is not None:
            build_parser().error(f"{flag} {port}: {taken}")
    tls_problem = _tls_problem(settings.tls_certfile, settings.tls_keyfile)
    if tls_problem is not None:
        build_parser().error(tls_problem)
    cores = len(os.sched_getaffinity(0))
    if engine_config.decode_threads + engine_config.vocoder_threads > cores:
        structlog.get_logger("agent_server.cli").warning(
            "threads_oversubscribed", threads=settings.threads, cores=cores,
            message="more compute threads than cores: OpenMP teams that outnumber the cores collapse (a step "
                    "several times slower); see --threads in the README")
    # The event loop shares the GIL with the engine thread; by default a thread holding it keeps it for
    # 5 ms, which would show up in every first frame's latency. 1 ms bounds that wait.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        app = create_app(settings=settings)
    except ValueError as exc:  # unusable auth settings (auth=on without keys, an unreadable keys file)
        build_parser().error(str(exc))
    server = build_server(app, settings)
    failures: list[str] = []

    def on_engine_failed(detail: str) -> None:
        failures.append(detail)
        structlog.get_logger("agent_server.cli").error("exiting_engine_failed", detail=detail,
                                                       exit_code=EXIT_ENGINE_FAILED)
        server.grace_s = min(server.grace_s, ENGINE_FAILED_GRACE_S)
        server.should_exit = True

    hub: Hub = app.state.hub
    hub.on_engine_failed = on_engine_failed

    def on_sighup(signum: int, frame: object) -> None:
        """Read the --prewarm list again and render what is new (the server keeps serving meanwhile)."""
        if hub.ready:  # (started: its loop exists)
            hub.post(hub.reload_prewarm)

    signal.signal(signal.SIGHUP, on_sighup)
    metrics_server = None
    if settings.metrics_port:
        try:
            metrics_server, metrics_thread = metrics.serve_in_thread(app, metrics_host, settings.metrics_port,
                                                                     log_level=settings.log_level)
        except OSError as exc:
            build_parser().error(f"--metrics-port {settings.metrics_port}: {exc.strerror or exc}")
    try:
        server.run()
    finally:
        if metrics_server is not None:
            metrics_server.should_exit = True
            metrics_thread.join(5)
    if failures:
        sys.exit(EXIT_ENGINE_FAILED)
    sys.exit(server.exit_status)


if __name__ == "__main__":
    main()
