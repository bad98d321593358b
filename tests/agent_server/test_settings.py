"""The settings' one table (agent_server/settings.py) and what is generated from it: the command line, the environment,
the grouped `--help`, the engine's configuration, values per model, and errors that name what the operator set."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from agent_server.cli import build_parser, settings_from
from agent_server.settings import ENV_VARS, Group, PerModel, Settings, SettingsError, table
from synth.api import EngineConfig, ModelOverrides

# Every flag and environment variable of main on 2026-12-06 (before the table), with a value each, what main's
# `settings_from` made of it (the setting, and the EngineConfig fields that moved from their defaults), recorded by
# running main's own code on these inputs (flag and variable gave the same). Each must still read the same.
# (flag, text or None for a switch, variables, setting, value, EngineConfig fields that changed)
MAIN_FLAGS: list[tuple[str, str | None, tuple[str, ...], str, object, dict[str, object]]] = [
    ('--host', '0.0.0.0', ('AGENT_SERVER_HOST',), 'host', '0.0.0.0', {}),
    ('--port', '9001', ('AGENT_SERVER_PORT', 'PORT'), 'port', 9001, {}),
    ('--variant', 'turbo', ('AGENT_SERVER_VARIANT',), 'variant', 'turbo', {'variant': 'turbo'}),
    ('--weights', 'random-tiny', ('AGENT_SERVER_WEIGHTS',), 'weights', 'random-tiny', {'weights': 'random-tiny'}),
    ('--device', 'cpu', ('AGENT_SERVER_DEVICE',), 'device', 'cpu', {'device': 'cpu'}),
    ('--dtype', 'bfloat16', ('AGENT_SERVER_DTYPE',), 'dtype', 'bfloat16', {'dtype': 'bfloat16'}),
    ('--cpu-weights', 'bf16', ('AGENT_SERVER_CPU_WEIGHTS',), 'cpu_weights', 'bf16', {'cpu_weights': 'bf16'}),
    ('--cpu-vocoder', 'bf16', ('AGENT_SERVER_CPU_VOCODER',), 'cpu_vocoder', 'bf16', {'cpu_vocoder': 'bf16'}),
    ('--cuda-graphs', 'off', ('AGENT_SERVER_CUDA_GRAPHS',), 'cuda_graphs', 'off', {'cuda_graphs': 'off'}),
    ('--vocoder-graphs', 'auto', ('AGENT_SERVER_VOCODER_GRAPHS',),
     'vocoder_graphs', 'auto', {'vocoder_graphs': 'auto'}),
    ('--threads', '3,1', ('AGENT_SERVER_THREADS',), 'threads', '3,1', {'decode_threads': 3, 'vocoder_threads': 1}),
    ('--lend-threads', 'vocoder', ('AGENT_SERVER_LEND_THREADS',),
     'lend_threads', 'vocoder', {'decode_borrows_threads': False}),
    ('--max-sessions', '77', ('AGENT_SERVER_MAX_SESSIONS',), 'max_sessions', 77, {}),
    ('--max-slots', '48', ('AGENT_SERVER_MAX_SLOTS',), 'max_slots', 48, {'max_slots': 48}),
    ('--queue-when-full', None, ('AGENT_SERVER_QUEUE_WHEN_FULL',), 'queue_when_full', True, {}),
    ('--alignment-analyzer', None, ('AGENT_SERVER_ALIGNMENT_ANALYZER',),
     'alignment_analyzer', True, {'variant': 'multilingual', 'alignment_analyzer': True}),
    ('--tls-cert', 'c.pem', ('AGENT_SERVER_TLS_CERT',), 'tls_certfile', 'c.pem', {}),
    ('--tls-key', 'k.pem', ('AGENT_SERVER_TLS_KEY',), 'tls_keyfile', 'k.pem', {}),
    ('--log-level', 'debug', ('AGENT_SERVER_LOG_LEVEL',), 'log_level', 'debug', {}),
    ('--data-dir', '/tmp/d', ('AGENT_SERVER_DATA_DIR',), 'data_dir', Path('/tmp/d'), {}),
    ('--metrics-port', '9100', ('AGENT_SERVER_METRICS_PORT',), 'metrics_port', 9100, {}),
    ('--metrics-host', '127.0.0.2', ('AGENT_SERVER_METRICS_HOST',), 'metrics_host', '127.0.0.2', {}),
    ('--grpc-port', '50051', ('AGENT_SERVER_GRPC_PORT',), 'grpc_port', 50051, {}),
    ('--encoder-threads', '3', ('AGENT_SERVER_ENCODER_THREADS',), 'encoder_threads', 3, {}),
    ('--shutdown-grace-s', '7.5', ('AGENT_SERVER_SHUTDOWN_GRACE_S',), 'shutdown_grace_s', 7.5, {}),
    ('--engine-factory', 'm:f', ('AGENT_SERVER_ENGINE_FACTORY',), 'engine_factory', 'm:f', {}),
    ('--inactivity-timeout-s', '33', ('AGENT_SERVER_INACTIVITY_TIMEOUT_S',), 'inactivity_timeout_s', 33.0, {}),
    ('--handshake-timeout-s', '4', ('AGENT_SERVER_HANDSHAKE_TIMEOUT_S',), 'handshake_timeout_s', 4.0, {}),
    ('--auth', 'off', ('AGENT_SERVER_AUTH',), 'auth', 'off', {}),
    ('--api-keys-file', '/tmp/keys', ('AGENT_SERVER_API_KEYS_FILE',), 'api_keys_file', Path('/tmp/keys'), {}),
    ('--allowed-origins', 'https://a.example, https://b.example', ('AGENT_SERVER_ALLOWED_ORIGINS',),
     'allowed_origins', ('https://a.example', 'https://b.example'), {}),
    ('--token-ttl-s', '60', ('AGENT_SERVER_TOKEN_TTL_S',), 'token_ttl_s', 60.0, {}),
    ('--metrics-auth', None, ('AGENT_SERVER_METRICS_AUTH',), 'metrics_auth', True, {}),
    ('--max-sessions-per-key', '5', ('AGENT_SERVER_MAX_SESSIONS_PER_KEY',), 'max_sessions_per_key', 5, {}),
    ('--max-text-chars-per-minute-per-key', '9000', ('AGENT_SERVER_MAX_TEXT_CHARS_PER_MINUTE_PER_KEY',),
     'max_text_chars_per_minute_per_key', 9000, {}),
    ('--redis-url', 'redis://r:6379/1', ('AGENT_SERVER_REDIS_URL',), 'redis_url', 'redis://r:6379/1', {}),
    ('--redis-prefix', 'p:', ('AGENT_SERVER_REDIS_PREFIX',), 'redis_prefix', 'p:', {}),
    ('--shared-lease-ttl-s', '3', ('AGENT_SERVER_SHARED_LEASE_TTL_S',), 'shared_lease_ttl_s', 3.0, {}),
    ('--agent-check-port', '9200', ('AGENT_SERVER_AGENT_CHECK_PORT',), 'agent_check_port', 9200, {}),
    ('--max-contexts-per-session', '9', ('AGENT_SERVER_MAX_CONTEXTS_PER_SESSION',), 'max_contexts_per_session', 9, {}),
    ('--max-text-piece-chars', '5000', ('AGENT_SERVER_MAX_TEXT_PIECE_CHARS',), 'max_text_piece_chars', 5000, {}),
    ('--max-context-text-chars', '200000', ('AGENT_SERVER_MAX_CONTEXT_TEXT_CHARS',),
     'max_context_text_chars', 200000, {}),
    ('--max-message-bytes', '65536', ('AGENT_SERVER_MAX_MESSAGE_BYTES',), 'max_message_bytes', 65536, {}),
    ('--max-protocol-errors', '7', ('AGENT_SERVER_MAX_PROTOCOL_ERRORS',), 'max_protocol_errors', 7, {}),
    ('--outbox-max-items', '100', ('AGENT_SERVER_OUTBOX_MAX_ITEMS',), 'outbox_max_items', 100, {}),
    ('--slow-client-stall-s', '2.5', ('AGENT_SERVER_SLOW_CLIENT_STALL_S',), 'slow_client_stall_s', 2.5, {}),
    ('--phrase-cache-mb', '12.5', ('AGENT_SERVER_PHRASE_CACHE_MB',), 'phrase_cache_mb', 12.5, {}),
    ('--phrase-cache-ttl-s', '600', ('AGENT_SERVER_PHRASE_CACHE_TTL_S',), 'phrase_cache_ttl_s', 600.0, {}),
    ('--cache-redis-url', 'redis://c:6379/0', ('AGENT_SERVER_CACHE_REDIS_URL',),
     'cache_redis_url', 'redis://c:6379/0', {}),
    ('--prewarm', '/tmp/prewarm.json', ('AGENT_SERVER_PREWARM',), 'prewarm_file', Path('/tmp/prewarm.json'), {}),
    ('--max-slots', 'auto', ('AGENT_SERVER_MAX_SLOTS',), 'max_slots', 0, {'max_slots': 0}),
    ('--threads', '4', ('AGENT_SERVER_THREADS',), 'threads', '4', {'decode_threads': 1, 'vocoder_threads': 2}),
    ('--threads', 'auto', ('AGENT_SERVER_THREADS',), 'threads', 'auto', {}),
    ('--variant', 'multilingual', ('AGENT_SERVER_VARIANT',), 'variant', 'multilingual', {'variant': 'multilingual'}),
    ('--weights', '/ckpt/dir', ('AGENT_SERVER_WEIGHTS',), 'weights', '/ckpt/dir', {'weights': '/ckpt/dir'}),
    ('--allowed-origins', '', ('AGENT_SERVER_ALLOWED_ORIGINS',), 'allowed_origins', (), {}),
]
MAIN_ENVIRONMENT_ONLY = {"api_keys": ("AGENT_SERVER_API_KEYS",), "token_secret": ("AGENT_SERVER_TOKEN_SECRET",)}
MAIN_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
                   "off": False, "ON": True, "No": False}
# what a value needs beside it to be valid (the analyzer reads the multilingual model; TLS takes both files)
COMPANIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "alignment_analyzer": (["--variant", "multilingual"], {"AGENT_SERVER_VARIANT": "multilingual"}),
    "tls_certfile": (["--tls-key", "k.pem"], {"AGENT_SERVER_TLS_KEY": "k.pem"}),
    "tls_keyfile": (["--tls-cert", "c.pem"], {"AGENT_SERVER_TLS_CERT": "c.pem"}),
}
NEW_ENGINE_FIELDS = {"models", "per_model"}  # issue 37's; checked on their own below


def plain(value: object) -> object:
    """A value as main held it: one value for every model was a plain value."""
    if isinstance(value, PerModel) and not value.overrides:
        return value.default
    return value


def engine_changes(settings: Settings) -> dict[str, object]:
    default = dataclasses.asdict(EngineConfig())
    return {name: value for name, value in dataclasses.asdict(settings.engine_config()).items()
            if value != default[name] and name not in NEW_ENGINE_FIELDS}


@pytest.mark.parametrize(("flag", "raw", "env_names", "name", "value", "engine"), MAIN_FLAGS,
                         ids=[f"{row[0]} {row[1]}" for row in MAIN_FLAGS])
def test_every_flag_and_variable_of_main_reads_as_it_did(flag: str, raw: str | None, env_names: tuple[str, ...],
                                                         name: str, value: object, engine: dict[str, object]) -> None:
    extra_args, extra_env = COMPANIONS.get(name, ([], {}))
    by_flag = settings_from([flag, *([] if raw is None else [raw]), *extra_args], {})
    assert plain(getattr(by_flag, name)) == value
    assert engine_changes(by_flag) == engine
    assert ENV_VARS.get(name, ENV_VARS.get("models" if name == "variant" else name)) == env_names
    for env in env_names:
        by_env = settings_from([], {env: "yes" if raw is None else raw, **extra_env})
        assert plain(getattr(by_env, name)) == value, env
        assert engine_changes(by_env) == engine, env


def test_the_environment_only_settings_and_the_switch_words_of_main() -> None:
    assert {name: ENV_VARS[name] for name in MAIN_ENVIRONMENT_ONLY} == MAIN_ENVIRONMENT_ONLY
    keys = settings_from([], {"AGENT_SERVER_API_KEYS": "sk-a-0123456789abcdef, sk-b-0123456789abcdef,"}).api_keys
    assert keys == ("sk-a-0123456789abcdef", "sk-b-0123456789abcdef")
    assert settings_from([], {"AGENT_SERVER_TOKEN_SECRET": "s3cret"}).token_secret == "s3cret"
    for word, on in MAIN_BOOL_WORDS.items():
        assert settings_from([], {"AGENT_SERVER_QUEUE_WHEN_FULL": word}).queue_when_full is on, word
    flags = {action.option_strings[0] for action in build_parser()._actions if action.option_strings}
    assert {row[0] for row in MAIN_FLAGS} <= flags  # none lost
    assert "--api-keys" not in flags and "--token-secret" not in flags  # a secret never on a command line


def test_secrets_stay_out_of_the_repr() -> None:
    settings = Settings(api_keys=("sk-secret-0123456789",), token_secret="hmac-secret",
                        redis_url="redis://:pw@host:6379/0", cache_redis_url="redis://:pw2@host:6379/1")
    shown = repr(settings)
    for secret in ("sk-secret-0123456789", "hmac-secret", ":pw@", ":pw2@"):
        assert secret not in shown
    assert "host='127.0.0.1'" in shown  # (the rest is shown)


# ---- the table --------------------------------------------------------------------------------------------------


def test_each_row_is_complete_and_its_flag_and_variables_are_its_own() -> None:
    flags: list[str] = []
    variables: list[str] = []
    for name, row in table():
        assert row.help and row.env and all(v.isupper() for v in row.env), name
        assert row.flag is None or row.flag.startswith("--"), name
        flags += [row.flag] if row.flag else []
        variables += row.env
    assert len(flags) == len(set(flags)) and len(variables) == len(set(variables))
    internal = {f.name for f in dataclasses.fields(Settings)} - dict(table()).keys()
    assert internal == {"ws_ping_interval_s", "ws_ping_timeout_s", "max_audio_ahead_s", "socket_send_buffer_bytes",
                        "tick_s", "close_timeout_s", "min_voice_clip_s", "max_voice_clip_s", "max_voice_upload_bytes"}


def test_the_help_is_grouped_by_concern() -> None:
    text = build_parser().format_help()
    headings = [group.value + ":" for group in Group]
    at = [text.index(heading) for heading in headings]
    assert at == sorted(at)  # serving, engine, limits, fleet, security: in that order
    for name, row in table():
        if row.flag is None:
            assert f"${row.env[0]}" in text.split("environment only")[1], name
            continue
        group_at = text.index(row.group.value + ":")
        next_at = min([a for a in at if a > group_at] + [len(text)])
        assert re.search(rf"^\s+{re.escape(row.flag)}\b", text[group_at:next_at], re.M), (name, row.group)
    assert max(len(line) for line in text.splitlines()) <= 110


def test_the_engine_config_is_generated_from_the_engine_rows() -> None:
    settings = Settings()
    config = settings.engine_config()
    engine_rows = {name for name, row in table() if row.engine is not None}
    assert engine_rows == {"models", "weights", "device", "dtype", "cpu_weights", "cpu_vocoder", "cuda_graphs",
                           "vocoder_graphs", "overlap_steps", "threads", "lend_threads", "max_slots",
                           "alignment_analyzer"}
    assert config == EngineConfig(models=("english",))
    changed = settings.replace(device="cpu", dtype="bfloat16", threads="2,1", lend_threads="off").engine_config()
    assert (changed.device, changed.dtype, changed.decode_threads, changed.vocoder_threads) == ("cpu", "bfloat16", 2, 1)
    assert (changed.lend_threads, changed.decode_borrows_threads) == (False, False)
    assert settings.replace(overlap_steps="off").engine_config().overlap_steps == "off"
    assert settings_from(["--overlap-steps", "on"], {}).engine_config().overlap_steps == "on"


# ---- values per model -------------------------------------------------------------------------------------------


def test_max_slots_and_weights_per_model() -> None:
    settings = settings_from(["--variant", "turbo,multilingual", "--max-slots", "turbo=48,multilingual=auto",
                              "--weights", "random-tiny,multilingual=/ckpt/mtl"], {})
    assert settings.models == ("turbo", "multilingual") and settings.variant == "turbo"
    assert (settings.max_slots.of("turbo"), settings.max_slots.of("multilingual")) == (48, 0)
    config = settings.engine_config()
    assert (config.variant, config.models, config.max_slots, config.weights) == ("turbo", ("turbo", "multilingual"),
                                                                                 16, "random-tiny")
    assert config.per_model == {"turbo": ModelOverrides(max_slots=48),
                                "multilingual": ModelOverrides(max_slots=0, weights="/ckpt/mtl")}
    assert settings_from(["--variant", "all"], {}).models == ("english", "turbo", "multilingual")
    every = settings_from([], {"AGENT_SERVER_VARIANT": "turbo,english", "AGENT_SERVER_MAX_SLOTS": "24,english=8"})
    assert every.max_slots == PerModel(24, (("english", 8),)) and every.engine_config().max_slots == 24
    assert str(every.max_slots) == "24,english=8"


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SystemExit) as exited:
        settings_from(argv, environ or {})
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_refusals_name_the_flag_or_the_variable_that_was_set(capsys: pytest.CaptureFixture[str]) -> None:
    said = {
        "flag": refusal(capsys, ["--shutdown-grace-s", "-1"]),
        "variable": refusal(capsys, [], {"AGENT_SERVER_SHUTDOWN_GRACE_S": "-1"}),
        "unread flag": refusal(capsys, ["--port", "eighty"]),
        "unread variable": refusal(capsys, [], {"PORT": "eighty"}),
        "two": refusal(capsys, ["--max-text-piece-chars", "500", "--max-context-text-chars", "100"]),
        "unset other": refusal(capsys, ["--tls-cert", "c.pem"]),
        "model": refusal(capsys, ["--variant", "turbo,huge"]),
        "twice": refusal(capsys, ["--variant", "turbo,turbo"]),
        "unloaded": refusal(capsys, ["--variant", "turbo", "--max-slots", "multilingual=8"]),
        "per model": refusal(capsys, ["--variant", "turbo", "--max-slots", "turbo=-2"]),
        "analyzer": refusal(capsys, ["--variant", "english,turbo", "--alignment-analyzer"]),
        "choice": refusal(capsys, ["--cpu-weights", "int4"]),
    }
    assert said == {
        "flag": "agent-server: error: --shutdown-grace-s must be >= 0 (0: close at once)",
        "variable": "agent-server: error: $AGENT_SERVER_SHUTDOWN_GRACE_S must be >= 0 (0: close at once)",
        "unread flag": "agent-server: error: argument --port: 'eighty': not a whole number",
        "unread variable": "agent-server: error: $PORT='eighty': not a whole number",
        "two": "agent-server: error: --max-context-text-chars must be >= --max-text-piece-chars",
        "unset other": "agent-server: error: --tls-cert and --tls-key go together",
        "model": "agent-server: error: argument --variant: 'turbo,huge': 'huge' is not a model (one of english, "
                 "turbo, multilingual, or all)",
        "twice": "agent-server: error: argument --variant: 'turbo,turbo': a model is named twice",
        "unloaded": "agent-server: error: --max-slots names multilingual, which --variant does not load",
        "per model": "agent-server: error: --max-slots must be >= 0 (or auto) (for turbo)",
        "analyzer": "agent-server: error: --alignment-analyzer is for the multilingual model only: --variant does not "
                    "load it",
        "choice": "agent-server: error: --cpu-weights must be one of fp32, bf16",
    }


def test_settings_built_in_code_name_their_fields() -> None:
    with pytest.raises(SettingsError, match=r"^shutdown_grace_s must be >= 0") as refused:
        Settings(shutdown_grace_s=-1)
    assert refused.value.names == ("shutdown_grace_s",)
    with pytest.raises(SettingsError, match=r"^max_slots names turbo, which models does not load"):
        Settings(max_slots=PerModel(16, (("turbo", 4),)))
    with pytest.raises(ValueError, match=r"port must be in 1\.\.65535"):
        Settings(port=0)



# ---- jobs (issue 36): rows like any other, read by the job service ------------------------------------------------

# (flag, text, variable, JobsConfig field, its value)
JOB_FLAGS: list[tuple[str, str, str, str, object]] = [
    ("--jobs", "off", "AGENT_SERVER_JOBS", "enabled", False),
    ("--jobs-redis-url", "redis://j:6379/2", "AGENT_SERVER_JOBS_REDIS_URL", "redis_url", "redis://j:6379/2"),
    ("--max-job-chars", "5000", "AGENT_SERVER_MAX_JOB_CHARS", "max_job_chars", 5000),
    ("--job-ttl-s", "3600", "AGENT_SERVER_JOB_TTL_S", "job_ttl_s", 3600.0),
    ("--job-workers", "3", "AGENT_SERVER_JOB_WORKERS", "workers", 3),
    ("--job-visibility-s", "2.5", "AGENT_SERVER_JOB_VISIBILITY_S", "visibility_s", 2.5),
    ("--job-files-mb", "64", "AGENT_SERVER_JOB_FILES_MB", "files_mb", 64.0),
    ("--max-running-jobs-per-key", "9", "AGENT_SERVER_MAX_RUNNING_JOBS_PER_KEY", "max_running_jobs_per_key", 9),
    ("--job-chars-per-day-per-key", "100000", "AGENT_SERVER_JOB_CHARS_PER_DAY_PER_KEY", "job_chars_per_day_per_key",
     100000),
    ("--webhook-allow", "10.0.0.0/8, 192.168.1.7", "AGENT_SERVER_WEBHOOK_ALLOW", "webhook_allow",
     ("10.0.0.0/8", "192.168.1.7")),
]


@pytest.mark.parametrize(("flag", "raw", "env", "field", "value"), JOB_FLAGS, ids=[row[0] for row in JOB_FLAGS])
def test_each_job_setting_reaches_the_job_service(flag: str, raw: str, env: str, field: str, value: object) -> None:
    from agent_server.jobs.service import JobsConfig

    default = JobsConfig.from_settings(Settings())
    assert getattr(default, field) != value
    for settings in (settings_from([flag, raw], {}), settings_from([], {env: raw})):
        assert getattr(JobsConfig.from_settings(settings), field) == value
    row = dict(table())[next(name for name, row in table() if row.flag == flag)]
    assert row.group is Group.JOBS and row.env == (env,)


def test_the_job_defaults_and_the_webhook_secret() -> None:
    from agent_server.jobs.service import JobsConfig

    config = JobsConfig.from_settings(Settings())
    assert config == JobsConfig()  # the table's defaults are the service's
    assert settings_from(["--jobs", "on"], {}).jobs is True
    shared = settings_from(["--redis-url", "redis://r:6379/0"], {})
    assert JobsConfig.from_settings(shared).redis_url == "redis://r:6379/0"  # --redis-url, unless the jobs' own
    assert JobsConfig.from_settings(shared.replace(jobs_redis_url="redis://j:1/0")).redis_url == "redis://j:1/0"
    secret = settings_from([], {"AGENT_SERVER_WEBHOOK_SECRET": "root-of-secrets"})
    assert JobsConfig.from_settings(secret).webhook_secret == "root-of-secrets"
    assert "root-of-secrets" not in repr(secret) and "root-of-secrets" not in repr(JobsConfig.from_settings(secret))
    assert ENV_VARS["webhook_secret"] == ("AGENT_SERVER_WEBHOOK_SECRET",)
    assert "--webhook-secret" not in {a.option_strings[0] for a in build_parser()._actions if a.option_strings}


def test_job_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    fleet = ["--redis-url", "redis://r:6379/0", "--webhook-allow", "10.0.0.0/8"]
    said = {
        "cidr": refusal(capsys, ["--webhook-allow", "10.0.0.0/8,intranet"]),
        "fleet without a secret": refusal(capsys, fleet),
        "jobs redis without a secret": refusal(capsys, [], {"AGENT_SERVER_JOBS_REDIS_URL": "redis://j:6379/0",
                                                            "AGENT_SERVER_WEBHOOK_ALLOW": "10.0.0.0/8"}),
        "switch": refusal(capsys, ["--jobs", "maybe"]),
        "ttl": refusal(capsys, ["--job-ttl-s", "0"]),
    }
    assert said == {
        "cidr": "agent-server: error: argument --webhook-allow: '10.0.0.0/8,intranet': 'intranet' is not a CIDR "
                "network",
        "fleet without a secret": "agent-server: error: --webhook-allow with --redis-url needs "
                                  "$AGENT_SERVER_WEBHOOK_SECRET (the same on every replica)",
        "jobs redis without a secret": "agent-server: error: $AGENT_SERVER_WEBHOOK_ALLOW with "
                                       "$AGENT_SERVER_JOBS_REDIS_URL needs $AGENT_SERVER_WEBHOOK_SECRET (the same on "
                                       "every replica)",
        "switch": "agent-server: error: argument --jobs: 'maybe': not one of 1, true, yes, on, 0, false, no, off",
        "ttl": "agent-server: error: --job-ttl-s must be > 0",
    }
    assert settings_from(fleet, {"AGENT_SERVER_WEBHOOK_SECRET": "s"}).webhook_allow == ("10.0.0.0/8",)
    assert settings_from(["--webhook-allow", "127.0.0.0/8"], {}).webhook_allow == ("127.0.0.0/8",)  # embedded: ok
