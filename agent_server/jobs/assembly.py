"""A job's audio in the format a client asks for, made from its stored segments on the fly.

One function makes the bytes: `job_audio(source, job_id, fmt)` decodes the segments in order
(segment_audio.py) and feeds their PCM, as it comes, to one encoder of `fmt` (`codecs.make_encoder`: the very
encoders the live endpoints stream with), never drained (a drain pads silence), finished after the last segment.
So what a growing stream has sent is always a prefix of the finished file, and the finished file is the same
whether it was made in one pass or while the job was running: an encoder's output does not depend on how its
input was cut into pushes (tests/agent_server/jobs/test_assembly.py checks it for every format). A WAV file carries
the streaming header (sizes 0xFFFFFFFF, what browsers, ffmpeg and Python's wave module read) in both cases, for
the same reason.

- While the job runs (`wait=True`): each segment is sent once it is stored, the stream ends with the job; a job
  that fails, is cancelled or vanishes meanwhile ends it with `JobAudioAborted` (the HTTP response is then cut
  short, so a client cannot mistake it for the whole file).
- When it is done: `AudioFiles.file` makes the whole file once per (job, format) on this replica's disk and keeps
  it (least recently used dropped beyond `max_bytes`), so it can be served with Content-Length and Range. The
  replica that finishes a job makes the file of the job's own format at once (`prepare`, in the background): a
  client that polls for `done` and then asks for a range finds it made, instead of waiting for the whole file to be
  encoded (locust measured ~4 s for that first range on a loaded 2-core server).

Decoding and encoding are CPU work: they run through `offload` (a thread by default).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import structlog

from agent_server.audio.codecs import StreamEncoder, StreamFormat, make_encoder
from agent_server.jobs.model import Job, JobStatus
from agent_server.jobs.segment_audio import decode_segment

log = structlog.get_logger("agent_server.jobs.assembly")
T = TypeVar("T")
Offload = Callable[..., Awaitable[Any]]  # (fn, *args) -> fn(*args), somewhere off the event loop
DEFAULT_POLL_S = 0.25  # how often a growing stream looks for the next segment
DEFAULT_FILES_BYTES = 1 << 30


class SegmentSource(Protocol):
    """What assembly reads: a store (`store.JobStore`) is one."""

    async def get(self, job_id: str) -> Job | None: ...
    async def segment(self, job_id: str, index: int) -> bytes | None: ...


class JobAudioAborted(Exception):
    """The job stopped (failed, cancelled, expired) before its audio was complete."""


async def job_audio(source: SegmentSource, job_id: str, fmt: StreamFormat, *, wait: bool,
                    poll_s: float = DEFAULT_POLL_S, offload: Offload = asyncio.to_thread) -> AsyncIterator[bytes]:
    """The job's audio as `fmt`, in pieces. `wait`: wait for segments not stored yet (a running job); else
    every segment must be there (a done job). Raises JobAudioAborted."""
    job = await source.get(job_id)
    if job is None:
        raise JobAudioAborted(f"no job {job_id!r}")
    encoder = make_encoder(fmt)
    try:
        for index in range(job.segments_total):
            blob = await source.segment(job_id, index)
            while blob is None:
                if not wait:
                    raise JobAudioAborted(f"segment {index} of {job_id!r} is missing")
                await asyncio.sleep(poll_s)
                blob = await source.segment(job_id, index)
                if blob is None:
                    now = await source.get(job_id)
                    if now is None or now.status.finished:
                        blob = await source.segment(job_id, index)  # stored just before the job finished
                        if blob is None:
                            state = "gone" if now is None else now.status.wire
                            raise JobAudioAborted(f"job {job_id!r} is {state} (segment {index} never came)")
            piece = await offload(_push_segment, encoder, blob)
            if piece:
                yield piece
        tail = await offload(_finish, encoder)
        if tail:
            yield tail
    finally:
        if not encoder.finished:
            encoder.close()


def _push_segment(encoder: StreamEncoder, blob: bytes) -> bytes:
    pcm = decode_segment(blob)
    return b"".join(encoder.push(pcm)) if pcm.size else b""


def _finish(encoder: StreamEncoder) -> bytes:
    return b"".join(encoder.finish())


def encode_whole(pcm_segments: list[npt.NDArray[np.float32]], fmt: StreamFormat) -> bytes:
    """The file of these PCM segments in one pass (for tests and tools: what `job_audio` makes of them)."""
    encoder = make_encoder(fmt)
    out = b"".join(b"".join(encoder.push(pcm)) for pcm in pcm_segments if pcm.size)
    return out + b"".join(encoder.finish())


STALE_BUILD_S = 600.0  # a file being built is written to all the time: one untouched this long was left by a kill


class AudioFiles:
    """Finished jobs' files on this replica's disk, one per (job, format name), made on first request."""

    def __init__(self, directory: Path, *, max_bytes: int = DEFAULT_FILES_BYTES,
                 offload: Offload = asyncio.to_thread) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self._offload = offload
        self._building: dict[str, asyncio.Future[Path]] = {}
        self._preparing: set[asyncio.Task[None]] = set()
        self.prepared = 0  # files made by `prepare` (before anyone asked)

    def prepare(self, source: SegmentSource, job: Job, fmt_name: str, fmt: StreamFormat) -> None:
        """Make the file of a job that has just finished here, in the background (a request that comes meanwhile
        waits for the same build, never starts another)."""
        task = asyncio.create_task(self._prepare(source, job, fmt_name, fmt), name=f"job-file-{job.id}")
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)

    async def _prepare(self, source: SegmentSource, job: Job, fmt_name: str, fmt: StreamFormat) -> None:
        try:
            await self.file(source, job, fmt_name, fmt)
        except Exception as exc:  # a GET makes it later, or says why it cannot
            log.warning("job_file_not_prepared", job_id=job.id, output_format=fmt_name, error=str(exc))
            return
        self.prepared += 1

    async def close(self) -> None:
        """Stop the files being prepared (what is half made is removed)."""
        tasks = list(self._preparing)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def file(self, source: SegmentSource, job: Job, fmt_name: str, fmt: StreamFormat) -> Path:
        """The whole file of a done job. Raises JobAudioAborted (a segment missing) and ValueError (not done)."""
        if job.status != JobStatus.DONE:
            raise ValueError(f"job {job.id} is {job.status.wire}, not done")
        path = self.directory / f"{job.id}.{fmt_name}"
        if path.exists():
            os.utime(path)  # recently used
            return path
        building = self._building.get(path.name)
        if building is not None:
            return await asyncio.shield(building)
        future: asyncio.Future[Path] = asyncio.get_running_loop().create_future()
        self._building[path.name] = future
        try:
            await self._build(source, job, fmt, path)
            future.set_result(path)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # (marked retrieved: it is raised here, and to whoever waits on the build)
            raise
        finally:
            del self._building[path.name]
        await self._offload(self._evict, path)
        return path

    async def _build(self, source: SegmentSource, job: Job, fmt: StreamFormat, path: Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        out = await self._offload(open, temp, "wb")
        try:
            try:
                async for piece in job_audio(source, job.id, fmt, wait=False, offload=self._offload):
                    await self._offload(out.write, piece)
            finally:
                await self._offload(out.close)
            os.replace(temp, path)
        finally:
            temp.unlink(missing_ok=True)

    async def sweep(self, source: SegmentSource, ttl_s: float, now_s: float) -> int:
        """Remove the files of jobs whose results expired (`ttl_s` after they finished) or whose record is gone, and
        what a build cut off by a kill left behind (a temporary file untouched for STALE_BUILD_S). The number of
        files removed. A store that cannot be read raises, and nothing more is removed this time."""
        listed = await self._offload(self._listing)
        by_job: dict[str, list[Path]] = {}
        removed = 0
        for path, modified_s in listed:
            if path.name.startswith("."):
                if modified_s < now_s - STALE_BUILD_S and path.name[1:].split(".", 1)[0] not in self._building_jobs():
                    await self._offload(_remove, path)
                    removed += 1
            else:
                by_job.setdefault(path.name.split(".", 1)[0], []).append(path)
        for job_id, paths in by_job.items():
            job = await source.get(job_id)
            if job is None or job.expired(now_s, ttl_s):
                for path in paths:
                    await self._offload(_remove, path)
                removed += len(paths)
        return removed

    def _building_jobs(self) -> set[str]:
        return {name.split(".", 1)[0] for name in self._building}

    def _listing(self) -> list[tuple[Path, float]]:
        if not self.directory.is_dir():
            return []
        return [(p, p.stat().st_mtime) for p in self.directory.iterdir() if p.is_file()]

    def _evict(self, keep: Path) -> None:
        """Drop the least recently used files until the rest fit in `max_bytes` (never `keep`)."""
        files = [(p.stat(), p) for p in self.directory.iterdir() if p.is_file() and not p.name.startswith(".")]
        total = sum(st.st_size for st, _ in files)
        for st, path in sorted(files, key=lambda item: item[0].st_mtime):
            if total <= self.max_bytes:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                total -= st.st_size


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
