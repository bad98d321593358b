"""Server settings: ONE declarative table, filled from defaults < environment < command line.

Each setting is a field of `Settings` declared with `setting(...)`: the entry carries its flag, its environment
variables, its help text, its group in `--help`, how its text is read, how its value is checked, and the
EngineConfig fields it feeds (the engine's knobs). Everything else is generated from the table: the command line and
its grouped `--help` (cli.py), the environment mapping (`ENV_VARS`), the checks (`Settings.__post_init__`), the
engine's configuration (`Settings.engine_config`), and the errors, which name the flag or the variable the operator
set (`SettingsError.render`). A new setting is one entry here.

A few settings hold a value per model (`PerModel`): `--max-slots turbo=48,multilingual=16`, or one value for every
model (`--max-slots 16`, `auto`), or both (`--max-slots 24,turbo=48`).
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from synth.api import VARIANTS, EngineConfig, ModelOverrides, ThreadBudget, Variant

T = TypeVar("T")
MIB = 1024 * 1024
DTYPES = ("float32", "bfloat16", "float16")
CPU_WEIGHTS = ("fp32", "bf16")
CUDA_GRAPHS = ("auto", "on", "off")
LEND_THREADS = ("on", "vocoder", "off")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
AUTH_MODES = ("auto", "on", "off")
MAX_INACTIVITY_TIMEOUT_S = 180.0
ALL_MODELS = "all"  # --variant all: every model
BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class Group(enum.Enum):
    """The sections of `agent-server --help`, in this order."""

    SERVING = "serving: where and how the server listens, logs and keeps its data"
    ENGINE = "engine and GPU: the models, their weights, device, memory and threads"
    LIMITS = "limits: sessions, text, messages, deadlines, flow control"
    FLEET = "fleet: replicas, Redis, the phrase cache, the load balancer"
    SECURITY = "security: API keys, tokens, origins"
    JOBS = "jobs: long texts behind 202 Accepted, in the rows live speech leaves idle (POST /v1/jobs, docs/jobs.md)"


class SettingsError(ValueError):
    """A value the server refuses. `template` holds one `{}` per name in `names` (the settings concerned): rendered
    with the field names by default, with the flags or variables the operator used by the CLI."""

    def __init__(self, template: str, *names: str) -> None:
        self.template = template
        self.names = names
        super().__init__(self.render(lambda name: name))

    def render(self, label: Callable[[str], str]) -> str:
        return self.template.format(*(label(name) for name in self.names))


# ---- values per model ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PerModel(Generic[T]):
    """One value for every model, with exceptions per model."""

    default: T
    overrides: tuple[tuple[Variant, T], ...] = ()

    def of(self, model: Variant) -> T:
        return next((value for name, value in self.overrides if name == model), self.default)

    @property
    def models(self) -> tuple[Variant, ...]:
        return tuple(name for name, _ in self.overrides)

    def __str__(self) -> str:
        return ",".join([str(self.default), *(f"{name}={value}" for name, value in self.overrides)])


def per_model(read: Callable[[str], T], default: T) -> Callable[[str], PerModel[T]]:
    """A reader of `V`, `model=V,...` or `V,model=V,...` (a model named twice, or a name that is no model: an
    error); `default` stands for every model not named when no plain `V` is given."""

    def read_per_model(text: str) -> PerModel[T]:
        every = default
        overrides: dict[Variant, T] = {}
        for item in (part.strip() for part in text.split(",")):
            name, equals, value = item.partition("=")
            if not equals:
                every = read(item)
                continue
            model = name.strip().lower()
            if model not in VARIANTS:
                raise ValueError(f"{name.strip()!r} is not a model (one of {', '.join(VARIANTS)})")
            if model in overrides:
                raise ValueError(f"{model} is given twice")
            overrides[model] = read(value.strip())
        return PerModel(every, tuple(overrides.items()))

    return read_per_model


# ---- readers: the text of a flag or a variable -> a value (ValueError says why) -----------------------------


def text(raw: str) -> str:
    return raw


def optional_text(raw: str) -> str | None:
    return raw


def whole(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("not a whole number") from None


def number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("not a number") from None


def switch(raw: str) -> bool:
    if raw.lower() not in BOOL_WORDS:
        raise ValueError(f"not one of {', '.join(BOOL_WORDS)}")
    return BOOL_WORDS[raw.lower()]


def path(raw: str) -> Path:
    return Path(raw)


def optional_path(raw: str) -> Path | None:
    return Path(raw)


def comma_list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def on_off(raw: str) -> bool:
    """A flag that takes a value (`--jobs off`), read as a switch's words."""
    return switch(raw)


def cidr_list(raw: str) -> tuple[str, ...]:
    """A comma list of CIDR networks (`10.0.0.0/8,192.168.1.7`; a bare address is one host)."""
    items = comma_list(raw)
    for item in items:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"{item!r} is not a CIDR network") from None
    return items


def slot_count(raw: str) -> int:
    """A count of slots, or "auto" (0: as many as the free memory holds)."""
    return 0 if raw.strip().lower() == "auto" else whole(raw.strip())


def model_list(raw: str) -> tuple[Variant, ...]:
    """`turbo,multilingual` (the first is the default model) or `all`."""
    names = [name.lower() for name in comma_list(raw)]
    if names == [ALL_MODELS]:
        return VARIANTS
    for name in names:
        if name not in VARIANTS:
            raise ValueError(f"{name!r} is not a model (one of {', '.join(VARIANTS)}, or {ALL_MODELS})")
    if len(set(names)) != len(names):
        raise ValueError("a model is named twice")
    return tuple(cast(Variant, name) for name in names)


# ---- checks: a value -> what is wrong with it, said after the setting's name (None: nothing) -------------------


Check = Callable[[Any], str | None]


def one_of(*choices: str) -> Check:
    return lambda value: None if value in choices else f"must be one of {', '.join(choices)}"


def at_least(low: float, note: str = "") -> Check:
    return lambda value: None if value >= low else f"must be >= {low:g}{f' ({note})' if note else ''}"


def above(low: float) -> Check:
    return lambda value: None if value > low else f"must be > {low:g}"


def in_range(low: float, high: float, note: str = "") -> Check:
    return lambda value: None if low <= value <= high else f"must be in {low:g}..{high:g}{f' ({note})' if note else ''}"


def each_model(check: Check) -> Check:
    def check_each(value: PerModel[Any]) -> str | None:
        for model, item in (("", value.default), *value.overrides):
            problem = check(item)
            if problem is not None:
                return f"{problem}{f' (for {model})' if model else ''}"
        return None

    return check_each


def thread_spec(value: str) -> str | None:
    try:
        ThreadBudget.parse(value)
    except ValueError as exc:
        return str(exc).removeprefix("threads ")
    return None


def models_given(value: tuple[Variant, ...]) -> str | None:
    return None if value else "names no model"


# ---- the entry ---------------------------------------------------------------------------------------------------

EngineFields = Callable[[Any], Mapping[str, object]]


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the table (kept in its field's metadata)."""

    help: str
    group: Group
    read: Callable[[str], Any]  # the text of the flag or the variable -> the value
    flag: str | None  # None: environment only (a secret on a command line shows in `ps`)
    env: tuple[str, ...]  # the first one set wins
    check: Check | None = None
    choices: tuple[str, ...] = ()  # shown in --help
    engine: EngineFields | None = None  # the EngineConfig fields this value sets (None: the server's own)
    per_model: bool = False  # a PerModel value; its overrides become EngineConfig.per_model[model].<engine field>
    is_switch: bool = False  # a flag without a value (its variable takes yes/no words)
    metavar: str | None = None


def setting(default: T, help: str, group: Group, read: Callable[[str], T], *, flag: str | None, env: tuple[str, ...],
            check: Check | None = None, choices: tuple[str, ...] = (), engine: EngineFields | str | None = None,
            metavar: str | None = None, secret: bool = False) -> T:
    """A field of Settings and its row of the table. `engine`: the EngineConfig field of the same value (a name),
    or a function of the value giving EngineConfig fields. `secret`: never in a repr (nor a log line)."""
    if isinstance(engine, str):
        engine = _same_value_as(engine)
    if choices and check is None:
        check = one_of(*choices)
    row = Setting(help, group, read, flag, env, check, choices, engine, isinstance(default, PerModel),
                  read is switch, metavar)
    made: T = field(default=default, repr=not secret, metadata={"setting": row})
    return made


def _same_value_as(engine_field: str) -> EngineFields:
    return lambda value: {engine_field: value}


def _thread_counts(value: str) -> Mapping[str, object]:
    decode_threads, vocoder_threads = ThreadBudget.parse(value)
    return {"decode_threads": decode_threads, "vocoder_threads": vocoder_threads}


def _lending(value: str) -> Mapping[str, object]:
    return {"lend_threads": value != "off", "decode_borrows_threads": value == "on"}


def _models(value: tuple[Variant, ...]) -> Mapping[str, object]:
    return {"variant": value[0], "models": value}


S, E, L, F, X, J = Group.SERVING, Group.ENGINE, Group.LIMITS, Group.FLEET, Group.SECURITY, Group.JOBS


@dataclass(frozen=True, slots=True)
class Settings:
    # ---- serving ----
    host: str = setting("127.0.0.1", "interface to listen on", S, text, flag="--host", env=("AGENT_SERVER_HOST",))
    port: int = setting(8000, "TCP port", S, whole, flag="--port", env=("AGENT_SERVER_PORT", "PORT"),
                        check=in_range(1, 65535))
    tls_certfile: str | None = setting(None, "TLS certificate (PEM); serves wss:// and https:// with --tls-key", S,
                                       optional_text, flag="--tls-cert", env=("AGENT_SERVER_TLS_CERT",))
    tls_keyfile: str | None = setting(None, "TLS private key (PEM)", S, optional_text, flag="--tls-key",
                                      env=("AGENT_SERVER_TLS_KEY",))
    log_level: str = setting("info", "log level", S, text, flag="--log-level", env=("AGENT_SERVER_LOG_LEVEL",),
                             choices=LOG_LEVELS)
    data_dir: Path = setting(Path("data"), "where uploaded voices are kept (under voices/)", S, path,
                             flag="--data-dir", env=("AGENT_SERVER_DATA_DIR",))
    # Serve /metrics and /dashboard on this port too, from their own thread and event loop, so a flood of
    # WebSocket sessions cannot starve a scrape (0: only on the main port).
    metrics_port: int = setting(0, "also serve /metrics and /dashboard on this port (0: off)", S, whole,
                                flag="--metrics-port", env=("AGENT_SERVER_METRICS_PORT",),
                                check=in_range(0, 65535, "0: off"))
    metrics_host: str | None = setting(None, "the interface of --metrics-port (default: --host's); it asks for no "
                                       "key: a private one", S, optional_text, flag="--metrics-host",
                                       env=("AGENT_SERVER_METRICS_HOST",), metavar="HOST")
    # Serve NVIDIA Riva's TTS gRPC API (`SynthesizeOnline`, `Synthesize`) on this port too, with the same
    # auth, limits and metrics (0: off). TLS with the same certificate as the HTTP port when one is set.
    grpc_port: int = setting(0, "also serve NVIDIA Riva's TTS gRPC API on this port (0: off)", S, whole,
                             flag="--grpc-port", env=("AGENT_SERVER_GRPC_PORT",), check=in_range(0, 65535, "0: off"))
    # Threads that encode compressed output formats (MP3, Opus, AAC, FLAC) for every context, off the event
    # loop (agent_server/audio/encode_lane.py). PCM, G.711 and WAV are encoded inline and need none.
    encoder_threads: int = setting(2, "threads encoding MP3/Opus/AAC/FLAC output for all sessions", S, whole,
                                   flag="--encoder-threads", env=("AGENT_SERVER_ENCODER_THREADS",), check=at_least(1))
    shutdown_grace_s: float = setting(20.0, "on SIGTERM, how long in-flight speech may finish, then close 1001", S,
                                      number, flag="--shutdown-grace-s", env=("AGENT_SERVER_SHUTDOWN_GRACE_S",),
                                      check=at_least(0, "0: close at once"))
    # "module:callable" taking Settings and returning an unstarted EngineLike (tests, load tests, development).
    engine_factory: str | None = setting(None, "module:callable building the engine (tests and development)", S,
                                         optional_text, flag="--engine-factory", env=("AGENT_SERVER_ENGINE_FACTORY",),
                                         metavar="MODULE:CALLABLE")

    # ---- engine and GPU ----
    # The models this process serves, the first the default (a request that names none gets it).
    models: tuple[Variant, ...] = setting(
        ("english",), f"the models to serve, the default first: a comma list of {', '.join(VARIANTS)}, or "
        f"{ALL_MODELS}", E, model_list, flag="--variant", env=("AGENT_SERVER_VARIANT",), check=models_given,
        engine=_models, metavar="MODEL[,MODEL...]")
    # Which loaded model speaks a request, by the model and language fields it sends (agent_server/core/routing.py):
    # a JSON file replacing the built-in table (None: the built-in one).
    model_routes: Path | None = setting(
        None, "JSON file of the route table (which model serves which vendor model names; see docs/compatibility.md), "
        "replacing the built-in one", E, optional_path, flag="--model-routes", env=("AGENT_SERVER_MODEL_ROUTES",))
    # auto | random-tiny | random-full | PATH (a checkpoint directory); per model: turbo=PATH,...
    weights: PerModel[str] = setting(
        PerModel("auto"), "auto (a local checkpoint, else the hub, else random weights with a warning), random-tiny, "
        "random-full, or a checkpoint directory; per model: english=DIR,turbo=DIR", E, per_model(text, "auto"),
        flag="--weights", env=("AGENT_SERVER_WEIGHTS",), engine="weights")
    device: str = setting("auto", "auto, cpu, cuda, cuda:N", E, text, flag="--device", env=("AGENT_SERVER_DEVICE",),
                          engine="device")
    dtype: str = setting("float32", "T3 weights dtype", E, text, flag="--dtype", env=("AGENT_SERVER_DTYPE",),
                         choices=DTYPES, engine="dtype")
    # CPU, float32 only: "bf16" stores T3's projection weights as bfloat16 (rounded once) and computes in fp32:
    # one segment decodes 2-3x faster on a CPU (half the bytes streamed per step); see BENCHMARKS.md.
    cpu_weights: str = setting(
        "fp32", "CPU with float32: bf16 stores T3's projection weights as bfloat16 (rounded once, fp32 math; 2-3x "
        "faster decoding of one segment)", E, text, flag="--cpu-weights", env=("AGENT_SERVER_CPU_WEIGHTS",),
        choices=CPU_WEIGHTS, engine="cpu_weights")
    cpu_vocoder: str = setting(
        "fp32", "CPU with AVX512-BF16 or AMX: bf16 runs S3Gen's linear layers and convolutions as bfloat16 products "
        "(fp32 in between; about 2x the audio per second, close to but not bit-identical with fp32)", E, text,
        flag="--cpu-vocoder", env=("AGENT_SERVER_CPU_VOCODER",), choices=CPU_WEIGHTS, engine="cpu_vocoder")
    # The decode step and sampling as CUDA graphs, one per row / key bucket, captured at start-up: "auto" (on
    # with a CUDA device), "on" (requires one), "off" (eager, the CPU's path).
    cuda_graphs: str = setting(
        "auto", "capture the decode step and sampling as CUDA graphs per batch bucket at start-up: auto (on with "
        "CUDA), on, off", E, text, flag="--cuda-graphs", env=("AGENT_SERVER_CUDA_GRAPHS",), choices=CUDA_GRAPHS,
        engine="cuda_graphs")
    # The vocoder's renders as CUDA graphs, one per (batch, length bucket), captured the first time each is met:
    # "auto" (on with CUDA, eager if its start-up check fails), "on" (requires CUDA), "off". Off by default until
    # the GPU check has measured it (BENCHMARKS.md).
    vocoder_graphs: str = setting(
        "off", "CUDA: replay the vocoder's renders as CUDA graphs, one per (batch, length bucket), each captured when "
        "first met: auto (on with CUDA, eager if the start-up check fails), on, off (off until measured on a GPU)", E,
        text, flag="--vocoder-graphs", env=("AGENT_SERVER_VOCODER_GRAPHS",), choices=CUDA_GRAPHS,
        engine="vocoder_graphs")
    # Launch decode step k+1 before reading step k's sampled ids, so the host's work overlaps the device's:
    # "auto" (on with decode graphs), "on", "off". Off always with the alignment analyzer (it reads each step).
    overlap_steps: str = setting(
        "auto", "launch decode step k+1 before reading step k's ids, so host work overlaps the device's: auto (on "
        "with decode graphs), on, off", E, text, flag="--overlap-steps", env=("AGENT_SERVER_OVERLAP_STEPS",),
        choices=CUDA_GRAPHS, engine="overlap_steps")
    # CPU threads of the engine's decode thread and its vocoder worker: "auto" (split the cores between them),
    # "N" (split N), or "D,V". Their sum must not exceed the cores, or OpenMP collapses (synth/cpu_threads.py).
    threads: str = setting("auto", "CPU threads of the decode and the vocoder: auto (split the cores), N (split N) "
                           "or D,V", E, text, flag="--threads", env=("AGENT_SERVER_THREADS",), check=thread_spec,
                           engine=_thread_counts)
    # CPU (synth/cpu_threads.CoreLease): "on": the vocoder borrows the decode thread's cores for a turn's first
    # chunk and while the decode is idle, and the decode borrows the vocoder's while it has nothing to render,
    # where that makes a step faster on this machine (BorrowGain); "vocoder": only the first; "off": neither.
    lend_threads: str = setting(
        "on", "CPU: on: the decode's threads render a turn's first chunk (the decode pauses for it) and whatever "
        "renders while the decode is idle, and decode steps run on the vocoder's threads too while it has nothing to "
        "render, where that is faster on this machine; vocoder: only the first; off: neither", E, text,
        flag="--lend-threads", env=("AGENT_SERVER_LEND_THREADS",), choices=LEND_THREADS, engine=_lending)
    # Segments generating at once, per model; 0 ("auto"): as many as the GPU's free memory holds.
    max_slots: PerModel[int] = setting(
        PerModel(16), "segments the engine generates at once, per model: N, auto (as many as the GPU's free memory "
        "holds; printed at start), or per model turbo=48,multilingual=auto; a count that does not fit is refused", E,
        per_model(slot_count, 16), flag="--max-slots", env=("AGENT_SERVER_MAX_SLOTS",),
        check=each_model(at_least(0, "or auto")), engine="max_slots", metavar="N|auto|MODEL=N,...")
    # When every engine slot is taken, a context's first segment is refused at once (`busy`, so the
    # agent can fall back) unless this is set: then it waits in the engine's bounded admission queue,
    # ahead of other waiting segments. Later segments of a context always wait (never fail mid-turn).
    queue_when_full: bool = setting(False, "when every slot is taken, queue a new context's first segment instead "
                                    "of answering busy", E, switch, flag="--queue-when-full",
                                    env=("AGENT_SERVER_QUEUE_WHEN_FULL",))
    # Multilingual only: chatterbox's alignment analyzer per segment (suppresses early EOS, cuts runaway
    # tails and repetitions by reading three attention heads). Off by default, as in the issue.
    alignment_analyzer: bool = setting(False, "multilingual only: chatterbox's alignment analyzer (no early stop, no "
                                       "runaway tail)", E, switch, flag="--alignment-analyzer",
                                       env=("AGENT_SERVER_ALIGNMENT_ANALYZER",), engine="alignment_analyzer")

    # ---- limits ----
    max_sessions: int = setting(256, "open sessions at most, all protocols together (beyond: busy, close 1013)", L,
                                whole, flag="--max-sessions", env=("AGENT_SERVER_MAX_SESSIONS",), check=at_least(1))
    max_contexts_per_session: int = setting(
        8, "contexts open at once on one socket (multi-context protocols; past it: busy for that context)", L, whole,
        flag="--max-contexts-per-session", env=("AGENT_SERVER_MAX_CONTEXTS_PER_SESSION",), check=at_least(1))
    max_text_piece_chars: int = setting(4096, "characters in one text message", L, whole,
                                        flag="--max-text-piece-chars", env=("AGENT_SERVER_MAX_TEXT_PIECE_CHARS",),
                                        check=at_least(1))
    max_context_text_chars: int = setting(100_000, "characters pushed into one context", L, whole,
                                          flag="--max-context-text-chars",
                                          env=("AGENT_SERVER_MAX_CONTEXT_TEXT_CHARS",), check=at_least(1))
    max_message_bytes: int = setting(1 * MIB, "one WebSocket message or HTTP body (past it: 1009 / 413)", L, whole,
                                     flag="--max-message-bytes", env=("AGENT_SERVER_MAX_MESSAGE_BYTES",),
                                     check=at_least(1))
    max_protocol_errors: int = setting(32, "client errors per session before close 1008", L, whole,
                                       flag="--max-protocol-errors", env=("AGENT_SERVER_MAX_PROTOCOL_ERRORS",),
                                       check=at_least(1))
    outbox_max_items: int = setting(8192, "frames and events waiting for one client's socket (overflow: close 1008)",
                                    L, whole, flag="--outbox-max-items", env=("AGENT_SERVER_OUTBOX_MAX_ITEMS",),
                                    check=at_least(1))
    slow_client_stall_s: float = setting(3.0, "a client whose socket took nothing for this long is dropped (close "
                                         "1008)", L, number, flag="--slow-client-stall-s",
                                         env=("AGENT_SERVER_SLOW_CLIENT_STALL_S",), check=above(0))
    slow_client_behind_s: float = setting(5.0, "a client stalled 1 s that has not shown it reads (taken more than a "
                                          "kernel holds unread) for this long since its first unproven audio is "
                                          "dropped (close 1008)", L,
                                          number, flag="--slow-client-behind-s",
                                          env=("AGENT_SERVER_SLOW_CLIENT_BEHIND_S",), check=above(0))
    # A native session with no open context that sends nothing for this long is closed (1000). Any
    # client message resets it; `{"type": "keepalive"}` is the explicit keep-alive.
    inactivity_timeout_s: float = setting(
        20.0, f"close a native session idle this long with no open context (1..{MAX_INACTIVITY_TIMEOUT_S:g} s)", L,
        number, flag="--inactivity-timeout-s", env=("AGENT_SERVER_INACTIVITY_TIMEOUT_S",),
        check=in_range(1, MAX_INACTIVITY_TIMEOUT_S))
    # A connection must complete its HTTP request head (a WebSocket handshake included) this soon after
    # it opens, or it is dropped (cli.HandshakeDeadlineProtocol; uvicorn itself has no such deadline).
    handshake_timeout_s: float = setting(
        10.0, "drop a connection that has not sent its request head (or WebSocket handshake) by then (0: never)", L,
        number, flag="--handshake-timeout-s", env=("AGENT_SERVER_HANDSHAKE_TIMEOUT_S",),
        check=at_least(0, "0: no deadline"))

    # ---- security (agent_server/fleet/auth.py, docs/operations.md) ----
    # on | off | auto: on when API keys are configured, else off with a loud warning ("auth_off").
    auth: str = setting("auto", "on, off, or auto (on when API keys are configured)", X, text, flag="--auth",
                        env=("AGENT_SERVER_AUTH",), choices=AUTH_MODES)
    api_keys: tuple[str, ...] = setting((), "API keys, a comma list", X, comma_list, flag=None,
                                        env=("AGENT_SERVER_API_KEYS",), secret=True)
    api_keys_file: Path | None = setting(None, "file of API keys, one per line (also $AGENT_SERVER_API_KEYS, a comma "
                                         "list)", X, optional_path, flag="--api-keys-file",
                                         env=("AGENT_SERVER_API_KEYS_FILE",))
    # HMAC secret of /v1/tokens tokens ("": random per process); no flag, for the same reason
    token_secret: str = setting("", "HMAC secret of /v1/tokens tokens (unset: random per process)", X, text,
                                flag=None, env=("AGENT_SERVER_TOKEN_SECRET",), secret=True)
    token_ttl_s: float = setting(300.0, "the longest life of a POST /v1/tokens token", X, number,
                                 flag="--token-ttl-s", env=("AGENT_SERVER_TOKEN_TTL_S",), check=above(0))
    allowed_origins: tuple[str, ...] = setting((), "comma list of browser Origins allowed (empty: any)", X,
                                               comma_list, flag="--allowed-origins",
                                               env=("AGENT_SERVER_ALLOWED_ORIGINS",))
    metrics_auth: bool = setting(False, "require credentials for /metrics and /dashboard/stream too", X, switch,
                                 flag="--metrics-auth", env=("AGENT_SERVER_METRICS_AUTH",))
    max_sessions_per_key: int = setting(0, "concurrent sessions per API key (0: no limit)", X, whole,
                                        flag="--max-sessions-per-key", env=("AGENT_SERVER_MAX_SESSIONS_PER_KEY",),
                                        check=at_least(0, "0: no limit"))
    max_text_chars_per_minute_per_key: int = setting(
        0, "text characters per minute per API key (0: no limit)", X, whole,
        flag="--max-text-chars-per-minute-per-key", env=("AGENT_SERVER_MAX_TEXT_CHARS_PER_MINUTE_PER_KEY",),
        check=at_least(0, "0: no limit"))

    # ---- fleet: replicas, shared state, phrase cache (docs/deploy.md) ----
    redis_url: str | None = setting(  # may hold a password
        None, "share keys, limits, voices and the phrase cache with other replicas through this Redis "
        "(redis://[:password@]host:6379/0); none: in this process", F, optional_text, flag="--redis-url",
        env=("AGENT_SERVER_REDIS_URL",), secret=True)
    redis_prefix: str = setting("agent-server:", "prefix of every Redis key (several deployments, one Redis)", F,
                                text, flag="--redis-prefix", env=("AGENT_SERVER_REDIS_PREFIX",))
    shared_lease_ttl_s: float = setting(10.0, "a dead replica's sessions stop counting against per-key limits within "
                                        "this", F, number, flag="--shared-lease-ttl-s",
                                        env=("AGENT_SERVER_SHARED_LEASE_TTL_S",), check=at_least(1))
    agent_check_port: int = setting(0, "serve HAProxy's agent check here: free capacity as a weight, drain, down "
                                    "(0: off)", F, whole, flag="--agent-check-port",
                                    env=("AGENT_SERVER_AGENT_CHECK_PORT",), check=in_range(0, 65535, "0: off"))
    phrase_cache_mb: float = setting(256.0, "in-process phrase cache budget in MiB (0: off)", F, number,
                                     flag="--phrase-cache-mb", env=("AGENT_SERVER_PHRASE_CACHE_MB",),
                                     check=at_least(0, "0: no phrase cache"))
    # an entry's life in Redis (its allkeys-lru may evict it sooner)
    phrase_cache_ttl_s: float = setting(86_400.0, "a phrase cache entry's life in Redis", F, number,
                                        flag="--phrase-cache-ttl-s", env=("AGENT_SERVER_PHRASE_CACHE_TTL_S",),
                                        check=above(0))
    cache_redis_url: str | None = setting(None, "the phrase cache's own Redis (allkeys-lru); default: --redis-url", F,
                                          optional_text, flag="--cache-redis-url",
                                          env=("AGENT_SERVER_CACHE_REDIS_URL",), secret=True)
    prewarm_file: Path | None = setting(None, "JSON list of phrases rendered into the phrase cache at start-up, "
                                        "before /readyz turns ready (reloaded on SIGHUP)", F, optional_path,
                                        flag="--prewarm", env=("AGENT_SERVER_PREWARM",))

    # ---- jobs (agent_server/jobs/, docs/jobs.md) ----
    jobs: bool = setting(True, "serve POST /v1/jobs and render jobs in idle rows (off: the jobs API answers 404 "
                         "jobs_off)", J, on_off, flag="--jobs", env=("AGENT_SERVER_JOBS",), metavar="on|off")
    # The jobs' records, queue and segment audio must not be evicted: a Redis with noeviction (or volatile-lru)
    jobs_redis_url: str | None = setting(
        None, "the jobs' own Redis (noeviction: job records must not be evicted); default: --redis-url; with neither, "
        "jobs live in SQLite under --data-dir/jobs", J, optional_text, flag="--jobs-redis-url",
        env=("AGENT_SERVER_JOBS_REDIS_URL",), secret=True)
    max_job_chars: int = setting(200_000, "characters in one job's text", J, whole, flag="--max-job-chars",
                                 env=("AGENT_SERVER_MAX_JOB_CHARS",), check=at_least(1))
    job_ttl_s: float = setting(86_400.0, "a finished job's audio is kept this long (then GET answers 404 "
                               "job_expired)", J, number, flag="--job-ttl-s", env=("AGENT_SERVER_JOB_TTL_S",),
                               check=above(0))
    job_workers: int = setting(0, "jobs rendered at once on this replica (0: the default model's --max-slots)", J,
                               whole, flag="--job-workers", env=("AGENT_SERVER_JOB_WORKERS",),
                               check=at_least(0, "0: max-slots"))
    job_visibility_s: float = setting(60.0, "a replica's job claims pass to another replica when it has not renewed "
                                      "them for this long (it died)", J, number, flag="--job-visibility-s",
                                      env=("AGENT_SERVER_JOB_VISIBILITY_S",), check=above(0))
    job_files_mb: float = setting(1024.0, "local disk cache of assembled job files in MiB (LRU)", J, number,
                                  flag="--job-files-mb", env=("AGENT_SERVER_JOB_FILES_MB",), check=at_least(0))
    max_running_jobs_per_key: int = setting(4, "unfinished (queued or running) jobs per API key (0: no limit)", J,
                                            whole, flag="--max-running-jobs-per-key",
                                            env=("AGENT_SERVER_MAX_RUNNING_JOBS_PER_KEY",),
                                            check=at_least(0, "0: no limit"))
    job_chars_per_day_per_key: int = setting(0, "job text characters per API key and UTC day (0: no limit)", J,
                                             whole, flag="--job-chars-per-day-per-key",
                                             env=("AGENT_SERVER_JOB_CHARS_PER_DAY_PER_KEY",),
                                             check=at_least(0, "0: no limit"))
    webhook_allow: tuple[str, ...] = setting((), "networks job webhooks may be sent to, a comma list of CIDRs "
                                             "(default: none, no webhook is accepted)", J, cidr_list,
                                             flag="--webhook-allow", env=("AGENT_SERVER_WEBHOOK_ALLOW",),
                                             metavar="CIDR[,CIDR...]")
    # the root of every key's webhook secret; no flag (a command line shows in `ps`)
    webhook_secret: str = setting("", "root of per-key webhook secrets (unset: random per process; a fleet "
                                  "needs it)", J, text, flag=None, env=("AGENT_SERVER_WEBHOOK_SECRET",),
                                  secret=True)

    # ---- internal: no flag, no variable (tests and load tests set them) ----
    ws_ping_interval_s: float = 20.0
    ws_ping_timeout_s: float = 20.0
    max_audio_ahead_s: float = 20.0  # per context: unsent audio beyond which the next segment waits
    # SO_SNDBUF of each WebSocket (0: the OS default, which Linux lets grow to megabytes and so hides a
    # client that stopped reading). 256 KiB holds ~2.7 s of 24 kHz PCM16 and is far more than any
    # real-time audio stream needs in flight.
    socket_send_buffer_bytes: int = 256 * 1024
    tick_s: float = 0.025  # segmenter poll and slow-client watchdog period
    close_timeout_s: float = 1.0  # how long a close frame may take before the connection is dropped
    min_voice_clip_s: float = 5.0
    max_voice_clip_s: float = 60.0
    max_voice_upload_bytes: int = 32 * MIB

    def __post_init__(self) -> None:
        for name, row in table():
            if row.check is not None:
                problem = row.check(getattr(self, name))
                if problem is not None:
                    raise SettingsError("{} " + problem, name)
        for check in CROSS_CHECKS:
            check(self)

    def replace(self, **changes: object) -> Settings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def variant(self) -> Variant:
        """The default model (a request that names none is spoken by it)."""
        return self.models[0]

    def engine_config(self) -> EngineConfig:
        """The engine's configuration, generated from the table's engine fields; a per-model value's exceptions go
        to `per_model`."""
        values: dict[str, object] = {}
        overrides: dict[Variant, dict[str, object]] = {}
        for name, row in table():
            if row.engine is None:
                continue
            value = getattr(self, name)
            if row.per_model:
                for model, item in value.overrides:
                    overrides.setdefault(model, {}).update(row.engine(item))
                value = value.default
            values.update(row.engine(value))
        per_model = {model: ModelOverrides(**fields) for model, fields in overrides.items()}  # type: ignore[arg-type]
        return EngineConfig(**values, per_model=per_model)  # type: ignore[arg-type]

    @property
    def voices_dir(self) -> Path:
        return self.data_dir / "voices"


def table() -> Iterator[tuple[str, Setting]]:
    """The table's rows, in declaration order: (field name, row)."""
    for item in dataclasses.fields(Settings):
        row = item.metadata.get("setting")
        if row is not None:
            yield item.name, row


# ---- checks of several settings together ------------------------------------------------------------------------


def _tls_pair(settings: Settings) -> None:
    if (settings.tls_certfile is None) != (settings.tls_keyfile is None):
        raise SettingsError("{} and {} go together", "tls_certfile", "tls_keyfile")


def _context_holds_a_piece(settings: Settings) -> None:
    if settings.max_context_text_chars < settings.max_text_piece_chars:
        raise SettingsError("{} must be >= {}", "max_context_text_chars", "max_text_piece_chars")


def _analyzer_has_its_model(settings: Settings) -> None:
    if settings.alignment_analyzer and "multilingual" not in settings.models:
        raise SettingsError("{} is for the multilingual model only: {} does not load it", "alignment_analyzer",
                            "models")


def _per_model_values_name_loaded_models(settings: Settings) -> None:
    for name, row in table():
        if row.per_model:
            for model in getattr(settings, name).models:
                if model not in settings.models:
                    raise SettingsError(f"{{}} names {model}, which {{}} does not load", name, "models")


def _fleet_webhooks_have_a_secret(settings: Settings) -> None:
    """Replicas each drawing a random secret would sign one key's webhooks with different secrets."""
    if settings.webhook_allow and not settings.webhook_secret and (settings.redis_url or settings.jobs_redis_url):
        shared = "jobs_redis_url" if settings.jobs_redis_url else "redis_url"
        raise SettingsError("{} with {} needs {} (the same on every replica)", "webhook_allow", shared,
                            "webhook_secret")


CROSS_CHECKS: tuple[Callable[[Settings], None], ...] = (
    _tls_pair, _context_holds_a_piece, _analyzer_has_its_model, _per_model_values_name_loaded_models,
    _fleet_webhooks_have_a_secret)

# setting name -> environment variables that set it (the first one set wins)
ENV_VARS: Mapping[str, tuple[str, ...]] = {name: row.env for name, row in table()}
