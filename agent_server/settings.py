"""Server settings: one frozen dataclass, filled from defaults < environment < command line (see cli.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from synth.api import VARIANTS, EngineConfig, ThreadBudget, Variant

MIB = 1024 * 1024
WEIGHTS_KEYWORDS = ("auto", "random-tiny", "random-full")
DTYPES = ("float32", "bfloat16", "float16")
CPU_WEIGHTS = ("fp32", "bf16")
CUDA_GRAPHS = ("auto", "on", "off")
LEND_THREADS = ("on", "vocoder", "off")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
AUTH_MODES = ("auto", "on", "off")
MAX_INACTIVITY_TIMEOUT_S = 180.0


@dataclass(frozen=True, slots=True)
class Settings:
    # ---- start-up (each has a command-line flag and an environment variable, see cli.py) ----
    host: str = "127.0.0.1"
    port: int = 8000
    variant: Variant = "english"
    weights: str = "auto"  # auto | random-tiny | random-full | PATH (a checkpoint directory)
    device: str = "auto"
    dtype: str = "float32"
    # CPU, float32 only: "bf16" stores T3's projection weights as bfloat16 (rounded once) and computes in fp32:
    # one segment decodes 2-3x faster on a CPU (half the bytes streamed per step); see BENCHMARKS.md.
    cpu_weights: str = "fp32"
    cpu_vocoder: str = "fp32"
    # The decode step and sampling as CUDA graphs, one per row / key bucket, captured at start-up: "auto" (on
    # with a CUDA device), "on" (requires one), "off" (eager, the CPU's path).
    cuda_graphs: str = "auto"
    # The vocoder's renders as CUDA graphs, one per (batch, length bucket), captured the first time each is met:
    # "auto" (on with CUDA, eager if its start-up check fails), "on" (requires CUDA), "off". Off by default until
    # the GPU check has measured it (BENCHMARKS.md).
    vocoder_graphs: str = "off"
    # CPU threads of the engine's decode thread and its vocoder worker: "auto" (split the cores between them),
    # "N" (split N), or "D,V". Their sum must not exceed the cores, or OpenMP collapses (synth/cpu_threads.py).
    threads: str = "auto"
    # CPU (synth/cpu_threads.CoreLease): "on": the vocoder borrows the decode thread's cores for a turn's first
    # chunk and while the decode is idle, and the decode borrows the vocoder's while it has nothing to render,
    # where that makes a step faster on this machine (BorrowGain); "vocoder": only the first; "off": neither.
    lend_threads: str = "on"
    max_sessions: int = 256  # open WebSocket sessions, all protocols together; beyond: busy + close 1013
    max_slots: int = 16  # engine: segments generating at once; 0 ("auto"): as many as the GPU's free memory holds
    # When every engine slot is taken, a context's first segment is refused at once (`busy`, so the
    # agent can fall back) unless this is set: then it waits in the engine's bounded admission queue,
    # ahead of other waiting segments. Later segments of a context always wait (never fail mid-turn).
    queue_when_full: bool = False
    # Multilingual only: chatterbox's alignment analyzer per segment (suppresses early EOS, cuts runaway
    # tails and repetitions by reading three attention heads). Off by default, as in the issue.
    alignment_analyzer: bool = False
    tls_certfile: str | None = None
    tls_keyfile: str | None = None
    log_level: str = "info"
    data_dir: Path = Path("data")  # uploaded voices live under data_dir/voices
    # "module:callable" taking Settings and returning an unstarted EngineLike (tests, load tests, development).
    engine_factory: str | None = None
    # Serve /metrics and /dashboard on this port too, from their own thread and event loop, so a flood of
    # WebSocket sessions cannot starve a scrape (0: only on the main port).
    metrics_port: int = 0
    metrics_host: str | None = None  # the --metrics-port listener's interface (None: --host's)
    # Serve NVIDIA Riva's TTS gRPC API (`SynthesizeOnline`, `Synthesize`) on this port too, with the same
    # auth, limits and metrics (0: off). TLS with the same certificate as the HTTP port when one is set.
    grpc_port: int = 0
    shutdown_grace_s: float = 20.0  # SIGTERM: in-flight speech may finish for this long, then close 1001
    # Threads that encode compressed output formats (MP3, Opus, AAC, FLAC) for every context, off the event
    # loop (agent_server/audio/encode_lane.py). PCM, G.711 and WAV are encoded inline and need none.
    encoder_threads: int = 2

    # ---- protocol limits ----
    max_contexts_per_session: int = 8  # contexts open at once on one socket
    max_text_piece_chars: int = 4096  # one `text` message
    max_context_text_chars: int = 100_000  # everything pushed into one context
    max_message_bytes: int = 1 * MIB  # a bigger WebSocket message is closed with 1009 by the server
    max_protocol_errors: int = 32  # per session; then close 1008

    # ---- flow control ----
    outbox_max_items: int = 8192  # per session: frames + events waiting for the socket (overflow: close 1008)
    slow_client_stall_s: float = 3.0  # one send blocked this long: the client stopped reading (close 1008)
    max_audio_ahead_s: float = 20.0  # per context: unsent audio beyond which the next segment waits
    # SO_SNDBUF of each WebSocket (0: the OS default, which Linux lets grow to megabytes and so hides a
    # client that stopped reading). 256 KiB holds ~2.7 s of 24 kHz PCM16 and is far more than any
    # real-time audio stream needs in flight.
    socket_send_buffer_bytes: int = 256 * 1024
    tick_s: float = 0.025  # segmenter poll and slow-client watchdog period
    close_timeout_s: float = 1.0  # how long a close frame may take before the connection is dropped

    # ---- WebSocket keepalive ----
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0

    # ---- deadlines (docs/operations.md) ----
    # A native session with no open context that sends nothing for this long is closed (1000). Any
    # client message resets it; `{"type": "keepalive"}` is the explicit keep-alive.
    inactivity_timeout_s: float = 20.0
    # A connection must complete its HTTP request head (a WebSocket handshake included) this soon after
    # it opens, or it is dropped (cli.HandshakeDeadlineProtocol; uvicorn itself has no such deadline).
    handshake_timeout_s: float = 10.0

    # ---- access (agent_server/fleet/auth.py, docs/operations.md) ----
    # on | off | auto: on when API keys are configured, else off with a loud warning ("auth_off").
    auth: str = "auto"
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never logged
    api_keys_file: Path | None = None  # one key per line
    token_secret: str = field(default="", repr=False)  # HMAC secret of /v1/tokens tokens ("": random per process)
    token_ttl_s: float = 300.0  # the longest a token lives
    allowed_origins: tuple[str, ...] = ()  # browser Origins allowed (empty: any)
    metrics_auth: bool = False  # /metrics and /dashboard/stream need credentials too
    max_sessions_per_key: int = 0  # concurrent sessions (all protocols) per API key; 0: no limit
    max_text_chars_per_minute_per_key: int = 0  # text characters per minute per API key; 0: no limit

    # ---- beyond one GPU: replicas, shared state, phrase cache (docs/deploy.md) ----
    redis_url: str | None = field(default=None, repr=False)  # shared state in Redis (None: in this process)
    redis_prefix: str = "agent-server:"  # every Redis key starts with it (several deployments, one Redis)
    shared_lease_ttl_s: float = 10.0  # a dead replica's sessions stop counting against key limits within this
    agent_check_port: int = 0  # HAProxy agent check: free capacity as a weight, drain, down (0: off)
    phrase_cache_mb: float = 256.0  # in-process phrase cache budget (0: no phrase cache)
    phrase_cache_ttl_s: float = 86_400.0  # an entry's life in Redis (its allkeys-lru may evict it sooner)
    cache_redis_url: str | None = field(default=None, repr=False)  # the phrase cache's Redis (None: redis_url)
    prewarm_file: Path | None = None  # JSON list of phrases rendered at start-up, before /readyz turns ready

    # ---- voices ----
    min_voice_clip_s: float = 5.0
    max_voice_clip_s: float = 60.0
    max_voice_upload_bytes: int = 32 * MIB

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.cpu_weights not in CPU_WEIGHTS:
            raise ValueError(f"cpu_weights must be one of {', '.join(CPU_WEIGHTS)}")
        if self.cpu_vocoder not in CPU_WEIGHTS:
            raise ValueError(f"cpu_vocoder must be one of {', '.join(CPU_WEIGHTS)}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}")
        if self.vocoder_graphs not in CUDA_GRAPHS:
            raise ValueError(f"vocoder_graphs must be one of {', '.join(CUDA_GRAPHS)}")
        ThreadBudget.parse(self.threads)  # raises ValueError naming the accepted forms
        if self.lend_threads not in LEND_THREADS:
            raise ValueError(f"lend_threads must be one of {', '.join(LEND_THREADS)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if not (0 < self.port < 65536):
            raise ValueError("port must be in 1..65535")
        if not (0 <= self.grpc_port < 65536):
            raise ValueError("grpc_port must be in 0..65535 (0: off)")
        if not (0 <= self.metrics_port < 65536):
            raise ValueError("metrics_port must be in 0..65535 (0: off)")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("tls_certfile and tls_keyfile go together")
        if not 1.0 <= self.inactivity_timeout_s <= MAX_INACTIVITY_TIMEOUT_S:
            raise ValueError(f"inactivity_timeout_s must be in [1, {MAX_INACTIVITY_TIMEOUT_S:g}]")
        if self.max_context_text_chars < self.max_text_piece_chars:
            raise ValueError("max_context_text_chars must be >= max_text_piece_chars")
        if self.slow_client_stall_s <= 0:
            raise ValueError("slow_client_stall_s must be > 0")
        if self.shutdown_grace_s < 0:
            raise ValueError("shutdown_grace_s must be >= 0 (0: close at once)")
        if self.handshake_timeout_s < 0:
            raise ValueError("handshake_timeout_s must be >= 0 (0: no deadline)")
        if self.auth not in AUTH_MODES:
            raise ValueError(f"auth must be one of {', '.join(AUTH_MODES)}")
        if self.token_ttl_s <= 0:
            raise ValueError("token_ttl_s must be > 0")
        for name in ("max_sessions_per_key", "max_text_chars_per_minute_per_key"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit)")
        if self.alignment_analyzer and self.variant != "multilingual":
            raise ValueError("alignment_analyzer is for the multilingual variant only")
        if self.shared_lease_ttl_s < 1.0:
            raise ValueError("shared_lease_ttl_s must be >= 1")
        if not 0 <= self.agent_check_port < 65536:
            raise ValueError("agent_check_port must be in 0..65535 (0: off)")
        if self.phrase_cache_mb < 0 or self.phrase_cache_ttl_s <= 0:
            raise ValueError("phrase_cache_mb must be >= 0 and phrase_cache_ttl_s > 0")
        if self.max_slots < 0:
            raise ValueError("max_slots must be >= 1, or 0 (auto)")
        for name in ("max_sessions", "max_contexts_per_session", "outbox_max_items", "encoder_threads",
                     "max_text_piece_chars", "max_context_text_chars", "max_message_bytes", "max_protocol_errors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def replace(self, **changes: object) -> Settings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def engine_config(self) -> EngineConfig:
        decode_threads, vocoder_threads = ThreadBudget.parse(self.threads)
        return EngineConfig(
            variant=self.variant,
            weights=self.weights,
            device=self.device,
            dtype=self.dtype,
            cpu_weights=self.cpu_weights,
            cpu_vocoder=self.cpu_vocoder,
            cuda_graphs=self.cuda_graphs,
            vocoder_graphs=self.vocoder_graphs,
            max_slots=self.max_slots,
            alignment_analyzer=self.alignment_analyzer,
            decode_threads=decode_threads,
            vocoder_threads=vocoder_threads,
            lend_threads=self.lend_threads != "off",
            decode_borrows_threads=self.lend_threads == "on",
        )

    @property
    def voices_dir(self) -> Path:
        return self.data_dir / "voices"


# setting name -> environment variables that set it (first one found wins)
ENV_VARS: Mapping[str, tuple[str, ...]] = {
    "host": ("AGENT_SERVER_HOST",),
    "port": ("AGENT_SERVER_PORT", "PORT"),
    "variant": ("AGENT_SERVER_VARIANT",),
    "weights": ("AGENT_SERVER_WEIGHTS",),
    "device": ("AGENT_SERVER_DEVICE",),
    "dtype": ("AGENT_SERVER_DTYPE",),
    "cpu_weights": ("AGENT_SERVER_CPU_WEIGHTS",),
    "cpu_vocoder": ("AGENT_SERVER_CPU_VOCODER",),
    "cuda_graphs": ("AGENT_SERVER_CUDA_GRAPHS",),
    "vocoder_graphs": ("AGENT_SERVER_VOCODER_GRAPHS",),
    "threads": ("AGENT_SERVER_THREADS",),
    "lend_threads": ("AGENT_SERVER_LEND_THREADS",),
    "max_sessions": ("AGENT_SERVER_MAX_SESSIONS",),
    "max_slots": ("AGENT_SERVER_MAX_SLOTS",),
    "queue_when_full": ("AGENT_SERVER_QUEUE_WHEN_FULL",),
    "alignment_analyzer": ("AGENT_SERVER_ALIGNMENT_ANALYZER",),
    "tls_certfile": ("AGENT_SERVER_TLS_CERT",),
    "tls_keyfile": ("AGENT_SERVER_TLS_KEY",),
    "log_level": ("AGENT_SERVER_LOG_LEVEL",),
    "data_dir": ("AGENT_SERVER_DATA_DIR",),
    "engine_factory": ("AGENT_SERVER_ENGINE_FACTORY",),
    "metrics_port": ("AGENT_SERVER_METRICS_PORT",),
    "metrics_host": ("AGENT_SERVER_METRICS_HOST",),
    "grpc_port": ("AGENT_SERVER_GRPC_PORT",),
    "encoder_threads": ("AGENT_SERVER_ENCODER_THREADS",),
    "shutdown_grace_s": ("AGENT_SERVER_SHUTDOWN_GRACE_S",),
    "inactivity_timeout_s": ("AGENT_SERVER_INACTIVITY_TIMEOUT_S",),
    "handshake_timeout_s": ("AGENT_SERVER_HANDSHAKE_TIMEOUT_S",),
    "auth": ("AGENT_SERVER_AUTH",),
    "api_keys": ("AGENT_SERVER_API_KEYS",),  # comma list; no flag (a flag would show in `ps`)
    "api_keys_file": ("AGENT_SERVER_API_KEYS_FILE",),
    "token_secret": ("AGENT_SERVER_TOKEN_SECRET",),  # no flag, for the same reason
    "token_ttl_s": ("AGENT_SERVER_TOKEN_TTL_S",),
    "allowed_origins": ("AGENT_SERVER_ALLOWED_ORIGINS",),  # comma list
    "metrics_auth": ("AGENT_SERVER_METRICS_AUTH",),
    "max_sessions_per_key": ("AGENT_SERVER_MAX_SESSIONS_PER_KEY",),
    "max_text_chars_per_minute_per_key": ("AGENT_SERVER_MAX_TEXT_CHARS_PER_MINUTE_PER_KEY",),
    "redis_url": ("AGENT_SERVER_REDIS_URL",),  # may hold a password: no flag of its own needed, but allowed
    "redis_prefix": ("AGENT_SERVER_REDIS_PREFIX",),
    "shared_lease_ttl_s": ("AGENT_SERVER_SHARED_LEASE_TTL_S",),
    "agent_check_port": ("AGENT_SERVER_AGENT_CHECK_PORT",),
    "phrase_cache_mb": ("AGENT_SERVER_PHRASE_CACHE_MB",),
    "phrase_cache_ttl_s": ("AGENT_SERVER_PHRASE_CACHE_TTL_S",),
    "cache_redis_url": ("AGENT_SERVER_CACHE_REDIS_URL",),
    "prewarm_file": ("AGENT_SERVER_PREWARM",),
    "max_contexts_per_session": ("AGENT_SERVER_MAX_CONTEXTS_PER_SESSION",),
    "max_text_piece_chars": ("AGENT_SERVER_MAX_TEXT_PIECE_CHARS",),
    "max_context_text_chars": ("AGENT_SERVER_MAX_CONTEXT_TEXT_CHARS",),
    "max_message_bytes": ("AGENT_SERVER_MAX_MESSAGE_BYTES",),
    "max_protocol_errors": ("AGENT_SERVER_MAX_PROTOCOL_ERRORS",),
    "outbox_max_items": ("AGENT_SERVER_OUTBOX_MAX_ITEMS",),
    "slow_client_stall_s": ("AGENT_SERVER_SLOW_CLIENT_STALL_S",),
}
