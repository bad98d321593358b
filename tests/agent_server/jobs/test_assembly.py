"""agent_server.jobs: segment audio stored as Opus and decoded to exactly as many samples, in place; a job's file in
every format the same bytes whether encoded in one pass, segment by segment, or as a growing stream while the
job runs (every prefix a growing stream sent is a prefix of the file); Range parsing at its edges."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from agent_server.audio.codecs import make_encoder
from agent_server.jobs.assembly import STALE_BUILD_S, AudioFiles, JobAudioAborted, encode_whole, job_audio
from agent_server.jobs.byte_range import ByteRange, Unsatisfiable, parse_range
from agent_server.jobs.model import Job, JobStatus
from agent_server.jobs.request import JOB_FORMATS, job_format
from agent_server.jobs.segment_audio import decode_segment, encode_segment

from tests.agent_server.jobs.conftest import run

pytestmark = pytest.mark.timeout(120)

RATE_HZ = 24_000
NOW_S = 1_796_000_000.0


def speechlike(samples: int, seed: int) -> npt.NDArray[np.float32]:
    """A few harmonics with a moving pitch and some noise: something a codec has to work at."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / RATE_HZ
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(pitch) / RATE_HZ
    wave = sum(0.2 / k * np.sin(k * phase) for k in range(1, 6)) + 0.01 * rng.standard_normal(samples)
    return np.asarray(wave, dtype=np.float32)


SEGMENT_SAMPLES = (24_000, 7_681, 1, 30_007, 12_345)  # lengths that cut codec frames anywhere


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [encode_segment(speechlike(n, i)) for i, n in enumerate(SEGMENT_SAMPLES)]


# ---- segments stored as Opus ---------------------------------------------------------------------------


@pytest.mark.parametrize("samples", [0, 1, 479, 480, 481, 24_001])
def test_a_segment_decodes_to_exactly_its_samples_every_time(samples: int) -> None:
    pcm = speechlike(samples, 1)
    blob = encode_segment(pcm)
    assert encode_segment(pcm) == blob  # the same audio, the same bytes (any replica)
    decoded = decode_segment(blob)
    assert decoded.dtype == np.float32
    assert decoded.size == samples
    assert np.array_equal(decode_segment(blob), decoded)


def test_a_decoded_segment_is_in_place_and_close_to_the_original() -> None:
    pcm = speechlike(RATE_HZ * 2, 3)
    decoded = decode_segment(encode_segment(pcm))
    inner = slice(2_400, -2_400)

    def error_db(shift: int) -> float:
        shifted = np.roll(decoded, shift)[inner]
        return float(10 * np.log10(np.mean((shifted - pcm[inner]) ** 2) / np.mean(pcm[inner] ** 2)))

    errors = {shift: error_db(shift) for shift in range(-48, 49)}
    assert min(errors, key=lambda s: errors[s]) == 0  # no delay: the codec's pre-skip is trimmed
    assert errors[0] < -15.0  # 32 kbit/s Opus: well over 15 dB signal to noise on this signal


# ---- the file: one pass, segment by segment, growing ---------------------------------------------------


@dataclass
class Source:
    """Segments appear one by one (`reveal`), as a running job's do."""

    blobs: list[bytes]
    shown: int = 0
    status: JobStatus = JobStatus.RUNNING
    reads: int = 0

    @property
    def job(self) -> Job:
        return Job(id="job_1", key_id="k", created_at_s=NOW_S, voice="default", output_format="wav", seed=1,
                   text_chars=10, status=self.status, segments_total=len(self.blobs), segments_done=self.shown)

    async def get(self, job_id: str) -> Job | None:
        return self.job

    async def segment(self, job_id: str, index: int) -> bytes | None:
        self.reads += 1
        return self.blobs[index] if index < self.shown else None


async def collect(source: Source, fmt_name: str, *, wait: bool, pieces: list[bytes] | None = None) -> bytes:
    out = pieces if pieces is not None else []
    async for piece in job_audio(source, "job_1", job_format(fmt_name), wait=wait, poll_s=0.001):
        out.append(piece)
    return b"".join(out)


@pytest.mark.parametrize("fmt_name", JOB_FORMATS)
def test_one_pass_segment_by_segment_and_growing_give_the_same_bytes(fmt_name: str, blobs: list[bytes]) -> None:
    fmt = job_format(fmt_name)
    pcm = [decode_segment(b) for b in blobs]
    one_pass = encode_whole([np.concatenate(pcm)], fmt)
    assert encode_whole(pcm, fmt) == one_pass
    incremental = make_encoder(fmt)
    pieces = [b"".join(incremental.push(p)) for p in pcm]
    assert b"".join(pieces) + b"".join(incremental.finish()) == one_pass

    done = Source(blobs, shown=len(blobs), status=JobStatus.DONE)
    assert run(collect(done, fmt_name, wait=False)) == one_pass

    async def growing() -> None:
        source = Source(blobs)
        sent: list[bytes] = []
        reader = asyncio.create_task(collect(source, fmt_name, wait=True, pieces=sent))
        for shown in range(1, len(blobs) + 1):
            await asyncio.sleep(0.01)
            assert one_pass.startswith(b"".join(sent))  # what went out so far is the file's beginning
            source.shown = shown
        source.status = JobStatus.DONE
        assert await reader == one_pass

    run(growing())


def test_a_growing_stream_ends_with_an_error_when_the_job_fails(blobs: list[bytes]) -> None:
    async def scenario() -> None:
        source = Source(blobs, shown=2)
        sent: list[bytes] = []
        reader = asyncio.create_task(collect(source, "wav", wait=True, pieces=sent))
        await asyncio.sleep(0.02)
        source.status = JobStatus.FAILED
        with pytest.raises(JobAudioAborted, match="failed"):
            await reader
        assert len(b"".join(sent)) == 44 + 2 * (SEGMENT_SAMPLES[0] + SEGMENT_SAMPLES[1])  # header + two segments

    run(scenario())


def test_a_done_job_with_a_segment_missing_is_an_error_not_a_shorter_file(blobs: list[bytes]) -> None:
    with pytest.raises(JobAudioAborted, match="segment 3"):
        run(collect(Source(blobs, shown=3, status=JobStatus.DONE), "mp3", wait=False))


def test_the_finished_file_is_made_once_for_concurrent_requests_and_old_ones_are_dropped(
        tmp_path: Path, blobs: list[bytes]) -> None:
    async def scenario() -> None:
        source = Source(blobs, shown=len(blobs), status=JobStatus.DONE)
        files = AudioFiles(tmp_path / "files", max_bytes=10_000_000)
        paths = await asyncio.gather(*(files.file(source, source.job, "flac", job_format("flac")) for _ in range(4)))
        assert len(set(paths)) == 1
        assert source.reads == len(blobs)  # one build for four requests
        pcm = [decode_segment(b) for b in blobs]
        assert paths[0].read_bytes() == encode_whole(pcm, job_format("flac"))
        await files.file(source, source.job, "flac", job_format("flac"))
        assert source.reads == len(blobs)  # kept
        files.max_bytes = paths[0].stat().st_size  # room for one file: the older one goes
        wav = await files.file(source, source.job, "wav", job_format("wav"))
        assert wav.exists() and not paths[0].exists()

    run(scenario())


def test_a_sweep_removes_the_files_of_expired_and_gone_jobs_and_what_a_kill_left(tmp_path: Path,
                                                                                  blobs: list[bytes]) -> None:
    """Files of a job whose results expired (`ttl_s` after it finished) or whose record is gone are removed; a
    served job's stay. A build's temporary file untouched for STALE_BUILD_S (the process was killed mid-build) goes;
    a fresh one (a build under way) stays."""
    ttl_s = 3_600.0

    async def scenario() -> None:
        source = Source(blobs, shown=len(blobs), status=JobStatus.DONE)
        files = AudioFiles(tmp_path / "files", max_bytes=10_000_000)
        ids = ["job_kept", "job_expired", "job_gone"]
        finished_s = {"job_kept": NOW_S, "job_expired": NOW_S - ttl_s - 1.0}
        for job_id in ids:
            await files.file(source, replace(source.job, id=job_id), "wav", job_format("wav"))
        await files.file(source, replace(source.job, id="job_expired"), "flac", job_format("flac"))
        stale = files.directory / ".job_gone.mp3.0123"
        fresh = files.directory / ".job_kept.mp3.4567"
        for temp in (stale, fresh):
            temp.write_bytes(b"half")
        os.utime(stale, (NOW_S - STALE_BUILD_S - 1.0, NOW_S - STALE_BUILD_S - 1.0))
        os.utime(fresh, (NOW_S - 1.0, NOW_S - 1.0))

        class Store:
            async def get(self, job_id: str) -> Job | None:
                if job_id not in finished_s:
                    return None
                return replace(source.job, id=job_id, finished_at_s=finished_s[job_id])

            async def segment(self, job_id: str, index: int) -> bytes | None:
                return None

        removed = await files.sweep(Store(), ttl_s, NOW_S)
        assert removed == 4  # expired wav and flac, gone wav, the stale temporary file
        assert sorted(p.name for p in files.directory.iterdir()) == [".job_kept.mp3.4567", "job_kept.wav"]

    run(scenario())


# ---- Range ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("header", "expected"), [
    ("bytes=0-0", ByteRange(0, 0)),  # the first byte
    ("bytes=0-99", ByteRange(0, 99)),
    ("bytes=999-999", ByteRange(999, 999)),  # the last byte
    ("bytes=998-", ByteRange(998, 999)),
    ("bytes=500-5000", ByteRange(500, 999)),  # past the end: cut to it
    ("bytes=0-999", ByteRange(0, 999)),
    ("bytes=0-1000", ByteRange(0, 999)),
    ("bytes=-1", ByteRange(999, 999)),  # suffix: the last byte
    ("bytes=-100", ByteRange(900, 999)),
    ("bytes=-1000", ByteRange(0, 999)),
    ("bytes=-5000", ByteRange(0, 999)),  # a suffix longer than the file: all of it
    ("Bytes = 10-19", ByteRange(10, 19)),
    (None, None),
    ("bytes=5-4", None),  # last before first: ignored (the whole file)
    ("bytes=0-1,5-6", None),  # several ranges: ignored
    ("items=0-1", None),
    ("bytes=abc", None),
    ("bytes=-", None),
    ("bytes=1-2-3", None),
    ("bytes=١-٢", None),  # non-ASCII digits are no digits here
])
def test_a_range_header_is_read_as_rfc_9110_says(header: str | None, expected: ByteRange | None) -> None:
    assert parse_range(header, 1000) == expected


@pytest.mark.parametrize(("header", "size"), [
    ("bytes=1000-", 1000), ("bytes=1000-1000", 1000), ("bytes=5000-6000", 1000), ("bytes=-0", 1000),
    ("bytes=0-", 0), ("bytes=-5", 0),
])
def test_a_range_with_no_byte_of_the_file_is_unsatisfiable(header: str, size: int) -> None:
    with pytest.raises(Unsatisfiable) as caught:
        parse_range(header, size)
    assert caught.value.content_range == f"bytes */{size}"


def test_content_range_names_first_and_last_byte_inclusive() -> None:
    assert ByteRange(0, 99).content_range(1000) == "bytes 0-99/1000"
    assert ByteRange(0, 99).length == 100
    assert ByteRange(999, 999).length == 1
