"""The job record: one object per job, its status enum, its segment plan, and the JSON clients read.

A job is a long text rendered in the background (`POST /v1/jobs` answers 202 and an id). Its record holds
what the request asked for (voice, format, seed, sampling, language, webhook), where it is (`JobStatus`,
segments done of total, audio made so far) and who owns it (the API key). The text itself is not kept: at
submission it is cut into `JobSegment`s (agent_server/jobs/segments.py), and that plan, stored beside the
record, is what every replica renders from (a replica running a newer segmenter resumes the same plan).

Times are unix seconds (float) inside, ISO 8601 UTC on the wire.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from agent_server.core.outcomes import ANSWERS, Outcome, http_status
from agent_server.errors import FieldError
from synth.api import OUTPUT_SAMPLE_RATE_HZ

JOB_ID_PREFIX = "job_"
JOB_ID_RANDOM_HEX = 10
JOB_ID_TIME_HEX = 12  # milliseconds since the epoch: ids sort by creation (listing, newest first)
MS_PER_S = 1000.0
STATUS_NOT_FOUND = http_status(Outcome.NOT_FOUND)
STATUS_UNPROCESSABLE = 422  # a field at fault: the native HTTP error shape's answer to `bad_request` (core/outcomes.py)

# Error codes of the jobs API (besides errors.BAD_REQUEST and the other shared ones)
JOB_NOT_FOUND = "job_not_found"
JOB_EXPIRED = "job_expired"
JOB_NOT_READY = "job_not_ready"  # audio of a job that failed or was cancelled
QUOTA_RUNNING = "quota_running_jobs"
QUOTA_CHARS = "quota_daily_chars"


class JobStatus(enum.IntEnum):
    """Where a job is. Order matters: everything >= DONE is finished (and never changes again)."""

    QUEUED = 0
    RUNNING = 1
    DONE = 10
    FAILED = 11
    CANCELLED = 12

    @property
    def finished(self) -> bool:
        return self >= JobStatus.DONE

    @property
    def wire(self) -> str:
        """queued | running | done | failed | cancelled."""
        return self.name.lower()


@dataclass(frozen=True, slots=True)
class JobSegment:
    """One generation of a job: `text` is what the engine is given (normalised), `start_char`/`end_char`
    the range of the submitted text it says, `max_new_tokens` the bound on its generation (what bounds the
    time it can hold an engine row: docs in agent_server/jobs/segments.py)."""

    index: int
    text: str
    start_char: int
    end_char: int
    max_new_tokens: int

    def to_list(self) -> list[Any]:
        return [self.index, self.text, self.start_char, self.end_char, self.max_new_tokens]

    @classmethod
    def from_list(cls, item: Sequence[Any]) -> JobSegment:
        index, text, start, end, budget = item
        return cls(int(index), str(text), int(start), int(end), int(budget))


def plan_to_json(plan: Sequence[JobSegment]) -> bytes:
    return orjson.dumps([seg.to_list() for seg in plan])


def plan_from_json(raw: bytes | str) -> tuple[JobSegment, ...]:
    return tuple(JobSegment.from_list(item) for item in orjson.loads(raw))


class JobError(FieldError):
    """A jobs API request refused: a FieldError that knows its HTTP status (and, for 429, when to come back).
    Its body is the native HTTP error shape, `{"error": {"field", "message", "code"}}` (as /v1/voices and
    auth answer)."""

    def __init__(self, status_code: int, field: str, message: str, code: str, *,
                 retry_after_s: int | None = None) -> None:
        super().__init__(field, message, code, busy=status_code == 429)
        self.status_code = status_code
        self.retry_after_s = retry_after_s

    @property
    def outcome(self) -> Outcome:
        """How the request ended, in the one table of outcomes (core/outcomes.py), whose HTTP status this is."""
        if self.status_code == STATUS_UNPROCESSABLE:
            return Outcome.BAD_INPUT
        return next(outcome for outcome, answer in ANSWERS.items() if answer.http_status == self.status_code
                    and outcome not in (Outcome.BUSY, Outcome.DRAIN_CUT, Outcome.FAILED, Outcome.SLOW_CLIENT))

    def body(self) -> dict[str, Any]:
        return {"error": {"field": self.field, "message": self.message, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


@dataclass(slots=True)
class Job:
    """One job, as every replica sees it. Mutable: the store writes its progress; only the store's atomic
    operations change it where another replica could see the change."""

    id: str
    key_id: str  # the API key's fingerprint (auth.ANONYMOUS when auth is off)
    created_at_s: float
    # what was asked (the text lives on as the segment plan)
    voice: str
    output_format: str  # a name of jobs.formats.JOB_FORMATS
    seed: int  # the request's seed, or one drawn at submission: a resumed job sounds as one run would
    text_chars: int
    sampling: tuple[tuple[str, float | int], ...] = ()
    language: str | None = None
    webhook_url: str | None = None
    # where it is
    status: JobStatus = JobStatus.QUEUED
    segments_total: int = 0
    segments_done: int = 0
    audio_samples: int = 0  # 24 kHz samples stored so far
    started_at_s: float | None = None
    finished_at_s: float | None = None
    error: str | None = None
    claims: int = 0  # times a worker took it (a job that keeps killing its workers fails: store.MAX_CLAIMS)
    extra: dict[str, Any] = field(default_factory=dict)  # fields of a newer record this version does not know

    @property
    def audio_seconds(self) -> float:
        return self.audio_samples / OUTPUT_SAMPLE_RATE_HZ

    def expired(self, now_s: float, ttl_s: float) -> bool:
        """Its results are gone: it finished more than `ttl_s` ago."""
        return self.finished_at_s is not None and now_s >= self.finished_at_s + ttl_s

    def status_json(self) -> dict[str, Any]:
        """The body of `GET /v1/jobs/{id}` (and of the webhook)."""
        return {
            "id": self.id,
            "status": self.status.wire,
            "segments_done": self.segments_done,
            "segments_total": self.segments_total,
            "audio_seconds": round(self.audio_seconds, 3),
            "created_at": iso(self.created_at_s),
            "finished_at": None if self.finished_at_s is None else iso(self.finished_at_s),
            "error": self.error,
        }

    # ---- the stored form: one JSON object (SQLite column, Redis hash field) -------------------------

    def spec_json(self) -> bytes:
        """What never changes after submission."""
        return orjson.dumps({
            "id": self.id, "key_id": self.key_id, "created_at_s": self.created_at_s, "voice": self.voice,
            "output_format": self.output_format, "seed": self.seed, "text_chars": self.text_chars,
            "sampling": [list(pair) for pair in self.sampling], "language": self.language,
            "webhook_url": self.webhook_url, "segments_total": self.segments_total, **self.extra,
        })

    @classmethod
    def from_stored(cls, spec: bytes | str, progress: Mapping[str, Any]) -> Job:
        """A record from its spec JSON and its progress fields (status, segments_done, audio_samples,
        started_at_s, finished_at_s, error, claims; absent ones take their defaults)."""
        obj = orjson.loads(spec)
        known = {"id", "key_id", "created_at_s", "voice", "output_format", "seed", "text_chars", "sampling",
                 "language", "webhook_url", "segments_total"}
        return cls(
            id=str(obj["id"]), key_id=str(obj["key_id"]), created_at_s=float(obj["created_at_s"]),
            voice=str(obj["voice"]), output_format=str(obj["output_format"]), seed=int(obj["seed"]),
            text_chars=int(obj["text_chars"]),
            sampling=tuple((str(name), value) for name, value in obj.get("sampling", ())),
            language=obj.get("language"), webhook_url=obj.get("webhook_url"),
            segments_total=int(obj.get("segments_total", 0)),
            status=JobStatus(int(progress.get("status", JobStatus.QUEUED))),
            segments_done=int(progress.get("segments_done", 0)),
            audio_samples=int(progress.get("audio_samples", 0)),
            started_at_s=_float_or_none(progress.get("started_at_s")),
            finished_at_s=_float_or_none(progress.get("finished_at_s")),
            error=_str_or_none(progress.get("error")),
            claims=int(progress.get("claims", 0)),
            extra={k: v for k, v in obj.items() if k not in known},
        )


def new_job_id(now_s: float) -> str:
    """`job_` + creation time in ms (12 hex digits) + 10 random hex digits: ids sort by creation time."""
    ms = int(now_s * MS_PER_S)
    return f"{JOB_ID_PREFIX}{ms:0{JOB_ID_TIME_HEX}x}{secrets.token_hex(JOB_ID_RANDOM_HEX // 2)}"


def valid_job_id(value: str) -> bool:
    body = value.removeprefix(JOB_ID_PREFIX)
    return (value.startswith(JOB_ID_PREFIX) and len(body) == JOB_ID_TIME_HEX + JOB_ID_RANDOM_HEX
            and all(c in "0123456789abcdef" for c in body))


def iso(unix_s: float) -> str:
    """2026-12-06T10:00:00.123+00:00 (milliseconds, UTC)."""
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds")


def not_found(job_id: str) -> JobError:
    return JobError(STATUS_NOT_FOUND, "id", f"no job {job_id!r}", JOB_NOT_FOUND)


def expired(job: Job, ttl_s: float) -> JobError:
    ended_s = job.finished_at_s if job.finished_at_s is not None else job.created_at_s
    return JobError(STATUS_NOT_FOUND, "id",
                    f"job {job.id!r} expired at {iso(ended_s + ttl_s)}: results are kept {ttl_s:g} s after "
                    "a job ends (--job-ttl-s)", JOB_EXPIRED)


def _float_or_none(value: object) -> float | None:
    if value is None or value == "" or value == b"":
        return None
    return float(value)  # type: ignore[arg-type]


def _str_or_none(value: object) -> str | None:
    if value is None or value == "" or value == b"":
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
