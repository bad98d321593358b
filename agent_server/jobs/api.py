"""The jobs HTTP API (docs: /work/notes/jobs-plan.md until docs/jobs.md exists):

    POST   /v1/jobs                 {"text", ...} -> 202 {"id", "status": "queued", "status_url", "audio_url"},
                                    and a Location header
    GET    /v1/jobs?limit=&before=  the key's jobs, newest first -> {"jobs": [status...], "next": id | null}
    GET    /v1/jobs/{id}            -> status JSON (model.Job.status_json)
    DELETE /v1/jobs/{id}            cancel (a finished job is left as it is) -> status JSON
    GET    /v1/jobs/{id}/audio      ?output_format= (default: the job's) -> the audio:
                                    running: a growing stream (chunked) that ends with the job;
                                    done: the file with Content-Length, ETag and Range (206, 416)
    GET    /v1/jobs/webhook-secret  -> {"secret"}: the key's webhook signing secret (with `secret_of`)

Errors: the native HTTP shape `{"error": {"field", "message", "code"}}` with 400/404/409/413/422/429/503, a 429 with
Retry-After. A job belongs to the key that made it: another key gets 404, as for a job that never was.

`JobsApi` takes its collaborators (the store, the file cache, the key of a request, the key's limits, a clock,
hooks to the local runner: wake it for a new job, stop a cancelled one now), so the app wires it (the second phase:
auth's principal, settings, metrics); nothing here reads settings or globals.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agent_server.core.outcomes import Outcome, http_status
from agent_server.errors import UNAVAILABLE
from agent_server.jobs.assembly import DEFAULT_POLL_S, AudioFiles, JobAudioAborted, Offload, job_audio
from agent_server.jobs.byte_range import Unsatisfiable, parse_range
from agent_server.jobs.model import (
    JOB_NOT_READY,
    STATUS_UNPROCESSABLE,
    Job,
    JobError,
    JobStatus,
    expired,
    new_job_id,
    not_found,
    valid_job_id,
)
from agent_server.jobs.request import (
    DEFAULT_MAX_JOB_CHARS,
    NOTHING_TO_SAY,
    LanguageRoute,
    job_format,
    parse_job_request,
)
from agent_server.jobs.segments import plan_segments
from agent_server.jobs.store import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT, STORE_ERRORS, JobStore, KeyLimits
from agent_server.jobs.webhooks import AllowList, Resolver, WebhookRefused, check_url, system_resolver

log = structlog.get_logger("agent_server.jobs.api")

JOBS_PATH = "/v1/jobs"
STATUS_ACCEPTED = 202
STATUS_PARTIAL = 206
# error statuses: the one table of outcomes' (core/outcomes.py); STATUS_UNPROCESSABLE (422) for a field at fault
STATUS_CONFLICT = http_status(Outcome.NO_RESULT)
STATUS_TOO_LARGE = http_status(Outcome.TOO_LARGE)
STATUS_QUOTA = http_status(Outcome.OVER_LIMIT)
STATUS_RANGE = http_status(Outcome.OUT_OF_RANGE)
STATUS_UNAVAILABLE = http_status(Outcome.NOT_READY)
# a body holds up to max_job_chars characters at BODY_BYTES_PER_CHAR each, plus BODY_SLACK_BYTES: 12 bytes is the
# most JSON spends on one character (outside the BMP, as an escaped surrogate pair "\\ud83d\\ude00", which
# json.dumps' ensure_ascii writes); the characters themselves are counted after parsing
BODY_BYTES_PER_CHAR = 12
BODY_SLACK_BYTES = 64 * 1024
FILE_CHUNK_BYTES = 64 * 1024
SEED_LIMIT = 2**63
WEBHOOK_SECRET_PATH = JOBS_PATH + "/webhook-secret"


@dataclass(slots=True)
class ApiStats:
    """Counters for the metrics (`tts_jobs_submitted_total`, `tts_jobs_finished_total{status="cancelled"}`)."""

    accepted: int = 0
    refused_quota: int = 0  # 429
    bad_request: int = 0  # any other refusal of a submission (400, 413, 422)
    cancelled: int = 0  # jobs cancelled through this replica


class JobsApi:
    def __init__(self, store: JobStore, files: AudioFiles, *, route: LanguageRoute,
                 key_of: Callable[[Request], str], limits_for: Callable[[str], KeyLimits], webhook_allow: AllowList,
                 max_job_chars: int = DEFAULT_MAX_JOB_CHARS, resolve: Resolver = system_resolver,
                 clock: Callable[[], float] = time.time, on_submitted: Callable[[Job], None] | None = None,
                 on_cancelled: Callable[[str], None] | None = None, poll_s: float = DEFAULT_POLL_S,
                 offload: Offload = asyncio.to_thread, secret_of: Callable[[str], str] | None = None,
                 unavailable: Callable[[], JobError | None] = lambda: None) -> None:
        """`route`: the loaded model that speaks a job's language (request.LanguageRoute; read per request: the
        engine may load after the routes exist);
        `secret_of`: a key's webhook secret (None: no webhook-secret route); `unavailable`: an error every request
        gets while it says one (the store could not be opened)."""
        self.store = store
        self.files = files
        self.stats = ApiStats()
        self._route = route
        self._secret_of = secret_of
        self._unavailable = unavailable
        self.max_job_chars = max_job_chars
        self._key_of = key_of
        self._limits_for = limits_for
        self._allow = webhook_allow
        self._resolve = resolve
        self._clock = clock
        self._on_submitted = on_submitted
        self._on_cancelled = on_cancelled
        self._poll_s = poll_s
        self._offload = offload

    def routes(self) -> list[Route]:
        secret = [Route(WEBHOOK_SECRET_PATH, self._guarded(self.webhook_secret), methods=["GET"])] if (
            self._secret_of is not None) else []
        return [
            *secret,  # (before /v1/jobs/{job_id})
            Route(JOBS_PATH, self._guarded(self.create), methods=["POST"]),
            Route(JOBS_PATH, self._guarded(self.list_jobs), methods=["GET"]),
            Route(JOBS_PATH + "/{job_id}", self._guarded(self.status), methods=["GET"]),
            Route(JOBS_PATH + "/{job_id}", self._guarded(self.cancel), methods=["DELETE"]),
            Route(JOBS_PATH + "/{job_id}/audio", self._guarded(self.audio), methods=["GET"]),
        ]

    def _guarded(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """A JobError becomes its response; a store that cannot be reached, a 503."""

        async def endpoint(request: Request) -> Response:
            unavailable = self._unavailable()
            if unavailable is not None:
                return error_response(unavailable)
            try:
                response: Response = await handler(request)
                return response
            except JobError as error:
                return error_response(error)
            except STORE_ERRORS as exc:
                log.warning("job_store_unavailable", path=request.url.path, error=f"{type(exc).__name__}: {exc}"[:300])
                return error_response(JobError(STATUS_UNAVAILABLE, "", "the job store is unavailable; try again",
                                               UNAVAILABLE, retry_after_s=1))

        return endpoint

    # ---- POST /v1/jobs --------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        try:
            return await self._create(request)
        except JobError as error:
            if error.status_code == STATUS_QUOTA:
                self.stats.refused_quota += 1
            elif error.status_code < STATUS_UNAVAILABLE:
                self.stats.bad_request += 1
            raise

    async def _create(self, request: Request) -> Response:
        key_id = self._key_of(request)
        parsed = parse_job_request(await self._body(request), route=self._route, max_job_chars=self.max_job_chars)
        limits = self._limits_for(key_id)
        if 0 < limits.daily_chars < len(parsed.text):
            raise JobError(STATUS_UNPROCESSABLE, "text", f"{len(parsed.text)} characters: more than this key's daily "
                           f"quota of {limits.daily_chars}", "quota_daily_chars")
        if parsed.webhook_url is not None:
            try:
                await check_url(parsed.webhook_url, self._allow, self._resolve)
            except WebhookRefused as refused:
                raise JobError(STATUS_UNPROCESSABLE, "webhook_url", str(refused), "webhook_refused") from None
        plan = await self._offload(plan_segments, parsed.text, parsed.language)
        if not plan:
            raise JobError(STATUS_UNPROCESSABLE, "text", "the text has nothing to say", NOTHING_TO_SAY)
        now_s = self._clock()
        job = Job(id=new_job_id(now_s), key_id=key_id, created_at_s=now_s, voice=parsed.voice,
                  output_format=parsed.output_format,
                  seed=parsed.seed if parsed.seed is not None else secrets.randbelow(SEED_LIMIT),
                  text_chars=len(parsed.text), sampling=parsed.sampling, language=parsed.language,
                  webhook_url=parsed.webhook_url)
        refusal = await self.store.submit(job, plan, limits, now_s)
        if refusal is not None:
            raise JobError(STATUS_QUOTA, "", refusal.message, refusal.code, retry_after_s=refusal.retry_after_s)
        log.info("job_submitted", job_id=job.id, key_id=key_id, chars=job.text_chars, segments=len(plan),
                 output_format=job.output_format, webhook=job.webhook_url is not None)
        self.stats.accepted += 1
        if self._on_submitted is not None:
            self._on_submitted(job)
        status_url = f"{JOBS_PATH}/{job.id}"
        body = {"id": job.id, "status": job.status.wire, "status_url": status_url, "audio_url": status_url + "/audio"}
        return JSONResponse(body, status_code=STATUS_ACCEPTED, headers={"Location": status_url})

    async def _body(self, request: Request) -> bytes:
        """The body, refused (413) past what `max_job_chars` characters of JSON can take."""
        limit = BODY_BYTES_PER_CHAR * self.max_job_chars + BODY_SLACK_BYTES
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
        return bytes(body)

    # ---- GET /v1/jobs, GET and DELETE /v1/jobs/{id} -------------------------------------------------------

    async def list_jobs(self, request: Request) -> Response:
        key_id = self._key_of(request)
        limit = _int_param(request, "limit", DEFAULT_LIST_LIMIT, 1, MAX_LIST_LIMIT)
        before = request.query_params.get("before")
        if before is not None and not valid_job_id(before):
            raise JobError(STATUS_UNPROCESSABLE, "before", "must be a job id (the `next` of the previous page)",
                           "bad_request")
        # one ahead: is there more?
        jobs = await self.store.list_jobs(key_id, self._clock(), limit=limit + 1, before=before)
        page = jobs[:limit]
        more = len(jobs) > limit
        return JSONResponse({"jobs": [job.status_json() for job in page], "next": page[-1].id if more else None})

    async def status(self, request: Request) -> Response:
        return JSONResponse((await self._job(request)).status_json())

    async def cancel(self, request: Request) -> Response:
        job = await self._job(request)
        if not job.status.finished:
            after, changed = await self.store.finish(job.id, JobStatus.CANCELLED, None, self._clock())
            if after is not None:
                job = after
            if changed:
                self.stats.cancelled += 1
                log.info("job_cancelled", job_id=job.id, segments_done=job.segments_done)
                if self._on_cancelled is not None:
                    self._on_cancelled(job.id)
        return JSONResponse(job.status_json())

    async def webhook_secret(self, request: Request) -> Response:
        """The requesting key's webhook secret (what a receiver checks signatures with: jobs/webhooks.py)."""
        if self._secret_of is None:
            raise not_found("webhook-secret")
        key_id = self._key_of(request)
        return JSONResponse({"secret": self._secret_of(key_id), "key_id": key_id},
                            headers={"Cache-Control": "no-store"})

    async def _job(self, request: Request) -> Job:
        job_id = request.path_params["job_id"]
        job = await self.store.get(job_id) if valid_job_id(job_id) else None
        if job is None or job.key_id != self._key_of(request):
            raise not_found(job_id)
        if job.expired(self._clock(), self.store.job_ttl_s):
            raise expired(job, self.store.job_ttl_s)
        return job

    # ---- GET /v1/jobs/{id}/audio ----------------------------------------------------------------------

    async def audio(self, request: Request) -> Response:
        job = await self._job(request)
        fmt_name = request.query_params.get("output_format") or job.output_format
        fmt = job_format(fmt_name)
        if job.status in (JobStatus.FAILED, JobStatus.CANCELLED):
            raise JobError(STATUS_CONFLICT, "id", f"job {job.id} is {job.status.wire}: it has no audio", JOB_NOT_READY)
        if job.status != JobStatus.DONE:
            headers = {"Cache-Control": "no-store", "X-Job-Status": job.status.wire}
            if request.method == "HEAD":  # (not a stream that would run until the job ends)
                return Response(b"", media_type=fmt.mime_type, headers=headers)
            return StreamingResponse(self._growing(job, fmt_name), media_type=fmt.mime_type, headers=headers)
        try:
            path = await self.files.file(self.store, job, fmt_name, fmt)
        except JobAudioAborted as exc:
            raise JobError(STATUS_CONFLICT, "id", f"job {job.id}'s audio is incomplete: {exc}", JOB_NOT_READY) from None
        return await self._file_response(request, job, fmt_name, fmt.mime_type, path)

    async def _growing(self, job: Job, fmt_name: str) -> AsyncIterator[bytes]:
        try:
            async for piece in job_audio(self.store, job.id, job_format(fmt_name), wait=True, poll_s=self._poll_s,
                                         offload=self._offload):
                yield piece
        except JobAudioAborted as exc:
            log.info("job_audio_cut", job_id=job.id, reason=str(exc))
            raise  # the response ends without its last chunk: the client sees an incomplete body, not a file

    async def _file_response(self, request: Request, job: Job, fmt_name: str, media_type: str,
                             path: Path) -> Response:
        size = (await anyio.Path(path).stat()).st_size
        etag = f'"{job.id}.{fmt_name}.{size}"'
        headers = {"Accept-Ranges": "bytes", "ETag": etag, "Cache-Control": "private, max-age=3600",
                   "Content-Disposition": f'attachment; filename="{job.id}.{_extension(fmt_name)}"'}
        if_range = request.headers.get("if-range")
        try:
            wanted = parse_range(request.headers.get("range") if if_range in (None, etag) else None, size)
        except Unsatisfiable as unsatisfiable:
            error = JobError(STATUS_RANGE, "range", str(unsatisfiable), "range_not_satisfiable")
            return error_response(error, headers={"Content-Range": unsatisfiable.content_range})
        first, length, status = 0, size, 200
        if wanted is not None:
            first, length, status = wanted.first, wanted.length, STATUS_PARTIAL
            headers["Content-Range"] = wanted.content_range(size)
        headers["Content-Length"] = str(length)
        if request.method == "HEAD":
            return Response(b"", status_code=status, headers=headers, media_type=media_type)
        return StreamingResponse(_file_slice(path, first, length), status_code=status, headers=headers,
                                 media_type=media_type)


async def _file_slice(path: Path, first: int, length: int) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as file:
        await file.seek(first)
        left = length
        while left > 0:
            chunk = await file.read(min(FILE_CHUNK_BYTES, left))
            if not chunk:
                raise RuntimeError(f"{path} is shorter than its {first + length} bytes")
            left -= len(chunk)
            yield chunk


def error_response(error: JobError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers={**error.headers(), **(headers or {})})


def _too_large(limit: int) -> JobError:
    return JobError(STATUS_TOO_LARGE, "body", f"the body is over {limit} bytes (--max-job-chars)", "body_too_large")


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not low <= int(raw) <= high:
        raise JobError(STATUS_UNPROCESSABLE, name, f"must be an integer in [{low}, {high}]", "bad_request")
    return int(raw)


def _extension(fmt_name: str) -> str:
    return {"pcm": "pcm", "opus": "ogg", "aac": "aac"}.get(fmt_name, fmt_name)
