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
import dataclasses
import os
import re
import signal
import socket
import ssl
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
import uvicorn

from agent_server import metrics
from agent_server.app import create_app
from agent_server.core.hub import Hub
from agent_server.logging import configure_logging
from agent_server.settings import CPU_WEIGHTS, CUDA_GRAPHS, DTYPES, ENV_VARS, LEND_THREADS, LOG_LEVELS, Settings
from synth.api import VARIANTS

UVICORN_GRACEFUL_TIMEOUT_S = 5  # after our own drain, for whatever uvicorn still waits on
EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE: the engine died; a supervisor should restart the process
EXIT_DRAIN_CUT = 75  # EX_TEMPFAIL: shut down, but the grace period ran out with sessions still speaking
# uvicorn's WebSocket implementation: wsproto passes the Autobahn core cases (tests/agent_server/
# test_autobahn.py); "websockets-sansio" answers case 7.1.5 (a close inside a fragmented message) with 1002.
WS_IMPLEMENTATION = "wsproto"
ENGINE_FAILED_GRACE_S = 2.0  # after an engine failure: time for the sessions' error messages to go out
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
    add("--cpu-weights", "cpu_weights", "CPU with float32: bf16 stores T3's projection weights as bfloat16 "
        "(rounded once, fp32 math; 2-3x faster decoding of one segment)", choices=CPU_WEIGHTS)
    add("--cpu-vocoder", "cpu_vocoder", "CPU with AVX512-BF16 or AMX: bf16 runs S3Gen's linear layers and "
        "convolutions as bfloat16 products (fp32 in between; about 2x the audio per second, close to but not "
        "bit-identical with fp32)", choices=CPU_WEIGHTS)
    add("--cuda-graphs", "cuda_graphs", "capture the decode step and sampling as CUDA graphs per batch bucket at "
        "start-up: auto (on with CUDA), on, off", choices=CUDA_GRAPHS)
    add("--vocoder-graphs", "vocoder_graphs", "CUDA: replay the vocoder's renders as CUDA graphs, one per (batch, "
        "length bucket), each captured when first met: auto (on with CUDA, eager if the start-up check fails), on, "
        "off (off until measured on a GPU)", choices=CUDA_GRAPHS)
    add("--threads", "threads", "CPU threads of the decode and the vocoder: auto (split the cores), N (split N) "
        "or D,V")
    add("--lend-threads", "lend_threads", "CPU: on: the decode's threads render a turn's first chunk (the decode "
        "pauses for it) and whatever renders while the decode is idle, and decode steps run on the vocoder's threads "
        "too while it has nothing to render, where that is faster on this machine; vocoder: only the first; off: "
        "neither", choices=LEND_THREADS)
    add("--max-sessions", "max_sessions", "open WebSocket sessions at most", type=int)
    add("--max-slots", "max_slots", "segments the engine generates at once, or auto (as many as the GPU's free "
        "memory holds; printed at start); a count that does not fit is refused", type=slot_count)
    add(
        "--queue-when-full",
        "queue_when_full",
        "when every slot is taken, queue a new context's first segment instead of answering busy",
        action="store_const",
        const=True,
    )
    add("--alignment-analyzer", "alignment_analyzer",
        "multilingual only: chatterbox's alignment analyzer (no early stop, no runaway tail)",
        action="store_const", const=True)
    add("--tls-cert", "tls_certfile", "TLS certificate (PEM); serves wss:// and https:// with --tls-key")
    add("--tls-key", "tls_keyfile", "TLS private key (PEM)")
    add("--log-level", "log_level", "log level", choices=LOG_LEVELS)
    add("--data-dir", "data_dir", "where uploaded voices are kept")
    add("--metrics-port", "metrics_port", "also serve /metrics and /dashboard on this port (0: off)", type=int)
    add("--metrics-host", "metrics_host", "the interface of --metrics-port (default: --host's); it asks for no "
        "key: a private one")
    add("--grpc-port", "grpc_port", "also serve NVIDIA Riva's TTS gRPC API on this port (0: off)", type=int)
    add("--encoder-threads", "encoder_threads", "threads encoding MP3/Opus/AAC/FLAC output for all sessions",
        type=int)
    add("--shutdown-grace-s", "shutdown_grace_s", "on SIGTERM, how long in-flight speech may finish", type=float)
    add("--engine-factory", "engine_factory", "module:callable building the engine (tests and development)")
    add("--inactivity-timeout-s", "inactivity_timeout_s",
        "close a native session idle this long with no open context (1..180 s)", type=float)
    add("--handshake-timeout-s", "handshake_timeout_s",
        "drop a connection that has not sent its request head (or WebSocket handshake) by then (0: never)", type=float)
    add("--auth", "auth", "on, off, or auto (on when API keys are configured)", choices=("auto", "on", "off"))
    add("--api-keys-file", "api_keys_file",
        "file of API keys, one per line (also $AGENT_SERVER_API_KEYS, a comma list)")
    add("--allowed-origins", "allowed_origins", "comma list of browser Origins allowed (empty: any)", type=comma_list)
    add("--token-ttl-s", "token_ttl_s", "the longest life of a POST /v1/tokens token", type=float)
    add("--metrics-auth", "metrics_auth", "require credentials for /metrics and /dashboard/stream too",
        action="store_const", const=True)
    add("--max-sessions-per-key", "max_sessions_per_key", "concurrent sessions per API key (0: no limit)", type=int)
    add("--max-text-chars-per-minute-per-key", "max_text_chars_per_minute_per_key",
        "text characters per minute per API key (0: no limit)", type=int)
    add("--redis-url", "redis_url", "share keys, limits, voices and the phrase cache with other replicas "
        "through this Redis (redis://[:password@]host:6379/0); none: in this process")
    add("--redis-prefix", "redis_prefix", "prefix of every Redis key")
    add("--shared-lease-ttl-s", "shared_lease_ttl_s",
        "a dead replica's sessions stop counting against per-key limits within this", type=float)
    add("--agent-check-port", "agent_check_port",
        "serve HAProxy's agent check here: free capacity as a weight, drain, down (0: off)", type=int)
    add("--max-contexts-per-session", "max_contexts_per_session",
        "contexts open at once on one socket (multi-context protocols; past it: busy for that context)", type=int)
    add("--max-text-piece-chars", "max_text_piece_chars", "characters in one text message", type=int)
    add("--max-context-text-chars", "max_context_text_chars", "characters pushed into one context", type=int)
    add("--max-message-bytes", "max_message_bytes", "one WebSocket message or HTTP body (past it: 1009 / 413)",
        type=int)
    add("--max-protocol-errors", "max_protocol_errors", "client errors per session before close 1008", type=int)
    add("--outbox-max-items", "outbox_max_items", "frames and events waiting for one client's socket", type=int)
    add("--slow-client-stall-s", "slow_client_stall_s",
        "a client whose socket took nothing for this long is dropped (close 1008)", type=float)
    add("--phrase-cache-mb", "phrase_cache_mb", "in-process phrase cache budget in MiB (0: off)", type=float)
    add("--phrase-cache-ttl-s", "phrase_cache_ttl_s", "a phrase cache entry's life in Redis", type=float)
    add("--cache-redis-url", "cache_redis_url", "the phrase cache's own Redis (allkeys-lru); default: --redis-url")
    add("--prewarm", "prewarm_file", "JSON list of phrases rendered into the phrase cache at start-up, "
        "before /readyz turns ready (reloaded on SIGHUP)")
    return parser


def slot_count(raw: str) -> int:
    """--max-slots: a count, or "auto" (0)."""
    return 0 if raw.strip().lower() == "auto" else int(raw)


def comma_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def settings_from(argv: Sequence[str] | None, environ: Mapping[str, str]) -> Settings:
    """Defaults < environment < flags. Raises SystemExit (via argparse) on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values: dict[str, Any] = {}
    for name, env_names in ENV_VARS.items():
        value = getattr(args, name, None)  # api_keys and token_secret have no flag: environment only
        if value is None:
            raw = next((environ[e] for e in env_names if environ.get(e)), None)
            if raw is None:
                continue
            value = _convert(name, raw, fields[name].type, parser)
        values[name] = Path(value) if name in ("data_dir", "api_keys_file", "prewarm_file") else value
    try:
        return Settings(**values)
    except ValueError as exc:
        parser.error(_in_flag_names(str(exc), parser))
        raise  # unreachable: parser.error exits


def _in_flag_names(message: str, parser: argparse.ArgumentParser) -> str:
    """A Settings error names its fields ("tls_certfile"): the operator knows the flags ("--tls-cert")."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    # a field's name: with an underscore anywhere, a plain word ("port") only where it starts the message
    return re.sub(r"\b[a-z][a-z0-9_]*\b", lambda m: flags.get(m[0], m[0]) if "_" in m[0] or m.start() == 0
                  else m[0], message)


def _convert(name: str, raw: str, annotation: object, parser: argparse.ArgumentParser) -> Any:
    kind = str(annotation)
    if kind.startswith("tuple"):
        return comma_list(raw)
    if kind == "bool":
        if raw.lower() not in BOOL_WORDS:
            parser.error(f"{'/'.join(ENV_VARS[name])}={raw!r}: not one of {', '.join(BOOL_WORDS)}")
        return BOOL_WORDS[raw.lower()]
    try:
        if name == "max_slots":
            return slot_count(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        parser.error(f"{'/'.join(ENV_VARS[name])}={raw!r}: not a number")
    return raw


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
    for flag, path in (("--tls-cert", certfile), ("--tls-key", keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            return f"{flag} {path}: {exc.strerror or exc}"
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
