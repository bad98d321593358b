"""synth/vocoder_worker.py on a tiny English S3Gen: the worker thread, its chunk policy, cancel, voices."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest
import torch

from synth.api import EventKind, ListenerClock
from synth.outlet import Outlet
from synth.render_checkpoints import RenderInterrupted, stop_when
from synth.tiny_s3gen import build_s3gen
from synth.vocoder import Pcm, RenderJob, StreamingVocoder, VocoderStream, VocoderVoice
from synth.vocoder_worker import (
    JOB_TICK_MARGIN_FACTOR,
    ChunkPolicy,
    Feed,
    JobYield,
    Speech,
    StreamOpen,
    VocoderWorker,
    _VoiceReady,
)

from tests.synth.conftest import Collector
from tests.synth.test_vocoder import reference_wav, utterance

PROMPT_TOKENS = 50
POLICY = ChunkPolicy(first_chunk_tokens=6, schedule_tokens=(8, 16), max_chunk_tokens=16)


@dataclass(frozen=True)
class FakeVoice:
    """What the worker reads of an engine voice: key, s3gen_ref, voice_id."""

    voice_id: str
    key: str
    s3gen_ref: dict[str, Any]


@dataclass
class Setup:
    vocoder: StreamingVocoder
    voices: list[FakeVoice]
    lock: threading.Lock = field(default_factory=threading.Lock)
    registry: dict[str, Outlet] = field(default_factory=dict)


@pytest.fixture(scope="module")
def setup() -> Setup:
    torch.manual_seed(0)
    s3gen = build_s3gen("tiny", meanflow=False)
    ref = s3gen.embed_ref(reference_wav(), 24_000)
    vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=10, meanflow=False, prompt_max_tokens=PROMPT_TOKENS,
                               max_chunk_tokens=16)
    other = {**ref, "embedding": ref["embedding"] + 0.5}
    return Setup(vocoder, [FakeVoice("a", "key-a", ref), FakeVoice("b", "key-b", other)])


@pytest.fixture
def worker(setup: Setup) -> Iterator[VocoderWorker]:
    w = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    w.start()
    yield w
    w.stop()


def open_stream(setup: Setup, collector: Collector, rid: str, voice: FakeVoice, seed: int,
                listener: ListenerClock | None = None, reproducible: bool = True, live: bool = True,
                admitted_s: float = 0.0) -> StreamOpen:
    outlet = Outlet(rid, collector.sink_for(rid), setup.lock, setup.registry)
    return StreamOpen(request_id=rid, outlet=outlet, voice=voice, seed=seed, reproducible=reproducible,
                      listener=listener, admitted_s=admitted_s, live=live)


def final(rid: str, tokens: list[int], total: int) -> Feed:
    return Feed(rid, tuple(tokens), final=True, speech_tokens=total, finish_reason="eos")


def pcm(collector: Collector, rid: str) -> Pcm:
    chunks = collector.chunks(rid)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    return np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.float32)


def test_streams_speak_through_their_outlets(setup: Setup, worker: VocoderWorker) -> None:
    col = Collector()
    tokens = utterance(40, seed=1)
    opened = open_stream(setup, col, "s1", setup.voices[0], seed=3)
    worker.feed([opened, Feed("s1", tuple(tokens[:20]))])
    worker.feed([final("s1", tokens[20:], 40)])
    col.wait_done(["s1"])
    assert col.kinds("s1") == [EventKind.DONE]
    assert pcm(col, "s1").size == 40 * 960
    assert [c.speech_tokens for c in col.chunks("s1")][:3] == [6, 8, 16]  # the seeded schedule


def test_streams_without_a_client_seed_open_unreproducible(setup: Setup, worker: VocoderWorker,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker opens a stream reproducible only when the client gave the seed: the others may render through
    the library's faster kernels (StreamingVocoder.render), seeded ones keep the row-invariant ones."""
    opened: dict[int, bool] = {}
    real_open = setup.vocoder.open

    def spy(voice: VocoderVoice, seed: int, reproducible: bool = True) -> VocoderStream:
        opened[seed] = reproducible
        return real_open(voice, seed, reproducible)

    monkeypatch.setattr(setup.vocoder, "open", spy)
    col = Collector()
    tokens = utterance(20, seed=2)
    worker.feed([open_stream(setup, col, "seeded", setup.voices[0], seed=11, reproducible=True),
                 open_stream(setup, col, "unseeded", setup.voices[0], seed=12, reproducible=False),
                 final("seeded", tokens, 20), final("unseeded", tokens, 20)])
    col.wait_done(["seeded", "unseeded"])
    assert opened == {11: True, 12: False}
    assert pcm(col, "seeded").size == pcm(col, "unseeded").size == 20 * 960


def test_cancel_mid_render_drops_that_streams_audio_only(setup: Setup) -> None:
    """A render of three streams is held in flight; one is cancelled meanwhile: its chunk from that render is
    dropped (its outlet), and the worker renders it no more; the other two get every chunk and finish."""
    vocoder = setup.vocoder
    in_render, release = threading.Event(), threading.Event()
    rendered: list[list[int]] = []
    original = vocoder.render

    def held_render(jobs: Sequence[RenderJob]) -> list[Pcm]:
        rendered.append([job.stream.seed for job in jobs])
        if len(rendered) == 1:
            in_render.set()
            assert release.wait(60)
        return original(jobs)

    vocoder.render = held_render  # type: ignore[method-assign]
    worker = VocoderWorker(vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    worker.start()
    try:
        col = Collector()
        ids = ["x", "y", "z"]
        opens = [open_stream(setup, col, rid, setup.voices[0], seed=10 + i) for i, rid in enumerate(ids)]
        tokens = {rid: utterance(48, seed=20 + i) for i, rid in enumerate(ids)}
        worker.feed([item for o in opens for item in (o, Feed(o.request_id, tuple(tokens[o.request_id][:24])))])
        assert in_render.wait(60)
        assert sorted(rendered[0]) == [10, 11, 12]  # one tick, all three
        opens[1].outlet.cancel()  # what Engine.cancel does: the outlet first, then the worker
        worker.cancel("y")
        release.set()
        worker.feed([final(rid, tokens[rid][24:], 48) for rid in ids])
        col.wait_done(["x", "z"])
        assert not col.chunks("y") and not col.kinds("y")
        assert all(11 not in seeds for seeds in rendered[1:])  # never rendered again
        for rid in ("x", "z"):
            assert pcm(col, rid).size == 48 * 960 and col.kinds(rid) == [EventKind.DONE]
    finally:
        worker.stop()
        del vocoder.render


def test_a_voice_being_prepared_stalls_no_other_stream(setup: Setup) -> None:
    """While a new voice's preparation is held (it would take ~10 s for English on a CPU), four streams of a
    ready voice speak to the end; the new voice's stream waits and then speaks too."""
    vocoder = setup.vocoder
    started, release = threading.Event(), threading.Event()
    original = vocoder.prepare_voice

    def slow_prepare(ref_dict: dict[str, Any]) -> VocoderVoice:
        if ref_dict is setup.voices[1].s3gen_ref:
            started.set()
            assert release.wait(120)
        return original(ref_dict)

    vocoder.prepare_voice = slow_prepare  # type: ignore[method-assign]
    worker = VocoderWorker(vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    worker.start()
    try:
        worker.prepare_voice(setup.voices[0])
        assert worker.wait_prepared([setup.voices[0].key], 120)
        col = Collector()
        new_voice = open_stream(setup, col, "new", setup.voices[1], seed=99)
        worker.feed([new_voice, final("new", utterance(20, seed=9), 20)])
        assert started.wait(60)
        ids = [f"s{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            worker.feed([open_stream(setup, col, rid, setup.voices[0], seed=i), final(rid, utterance(30, seed=i), 30)])
        col.wait_done(ids)  # all four finished while the preparation is still held
        assert not release.is_set() and not col.chunks("new")
        release.set()
        col.wait_done(["new"])
        assert pcm(col, "new").size == 20 * 960
    finally:
        release.set()
        worker.stop()
        del vocoder.prepare_voice


def test_the_listener_about_to_run_dry_renders_first(setup: Setup, worker: VocoderWorker) -> None:
    """Two streams due at once with room for one per tick: the one whose listener holds less goes first."""
    narrow = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=1, on_sink_failed=lambda rid: None)
    col = Collector()
    rich, poor = ListenerClock(), ListenerClock()
    now = 1000.0
    rich.report(sent_audio_s=5.0, started_monotonic_s=now - 1.0)  # holds 4 s
    poor.report(sent_audio_s=1.2, started_monotonic_s=now - 1.0)  # holds 0.2 s
    for rid, listener, seed in (("rich", rich, 1), ("poor", poor, 2)):
        narrow.feed([open_stream(setup, col, rid, setup.voices[0], seed, listener, reproducible=False),
                     Feed(rid, tuple(utterance(120, seed=seed)))])
    narrow._drain(block=False)  # not started: driven by hand (its voice is prepared below, not by its thread)
    voice = setup.vocoder.prepare_voice(setup.voices[0].s3gen_ref)
    for speech in narrow._speeches.values():
        narrow._start_stream(speech, voice, setup.vocoder.prompt_cache(voice))
    tick = narrow._due(now)
    assert [speech.request_id for speech, _ in tick] == ["poor"]
    narrow.max_batch = 8
    assert [speech.request_id for speech, _ in narrow._due(now)] == ["poor", "rich"]  # both, most urgent first
    starving = ListenerClock()
    starving.report(sent_audio_s=0.5, started_monotonic_s=now - 1.0)  # ran dry half a second ago
    narrow.feed([open_stream(setup, col, "dry", setup.voices[0], 3, starving, reproducible=False),
                 Feed("dry", tuple(utterance(120, seed=3)))])
    narrow._drain(block=False)
    narrow._start_stream(narrow._speeches["dry"], voice, setup.vocoder.prompt_cache(voice))
    assert [speech.request_id for speech, _ in narrow._due(now)] == ["dry"]  # it renders alone, first
    # and chunk sizes follow what each holds: 4 s -> the largest; 0.5 s -> that much; a listener holding less
    # than a first chunk after the segment's first chunk -> everything ready (at least a first chunk, at most
    # max); a segment's first chunk -> the small one whatever is ready
    assert POLICY.chunk_tokens(3, 4.0, reproducible=False) == 16
    assert POLICY.chunk_tokens(3, 0.5, reproducible=False) == 12
    assert POLICY.chunk_tokens(3, 0.2, reproducible=False) == 6
    assert POLICY.chunk_tokens(3, 0.2, reproducible=False, ready_tokens=11) == 11
    assert POLICY.chunk_tokens(3, -2.0, reproducible=False, ready_tokens=40) == 16
    assert POLICY.chunk_tokens(0, 0.0, reproducible=False, ready_tokens=40) == 6
    assert POLICY.chunk_tokens(3, 0.5, reproducible=False, ready_tokens=40) == 12  # not dry: what it holds
    assert POLICY.chunk_tokens(3, 4.0, reproducible=True) == 16 and POLICY.chunk_tokens(1, 4.0, True) == 8
    assert POLICY.chunk_tokens(0, 4.0, reproducible=True) == 6
    # the worker hands the policy what is ready: the dry stream, past its first chunk, renders the most it can
    # (a small first chunk would stop at hold + 6)
    dry = narrow._speeches["dry"]
    assert dry.stream is not None and dry.stream.ready_tokens > POLICY.max_chunk_tokens
    dry.chunks_emitted = 1
    (_, job), = narrow._due(now)
    assert job.stop == dry.stream.mel_tokens + setup.vocoder.max_chunk_tokens  # the largest render there is


def test_job_chunks_render_only_in_ticks_no_live_stream_needs(setup: Setup) -> None:
    """Priority in the vocoder (JobYield): two job segments (all their tokens at once) beside one live turn. On a
    CPU: nothing of a job while the turn waits for its first audio (not even before the turn has a chunk's worth
    of tokens); the turn's first chunk alone; no job beside a due live chunk, nor while the live listener holds
    less than the margin; with no live chunk due and the listener holding enough, or a listener holding more than
    the horizon (`live_ahead_s`), one job chunk per tick, the oldest job first; the margin grows with the job
    ticks' time. On a GPU (batched renders): job chunks fill the
    tick beside a live listener that holds enough, never beside one that holds less than the margin. A job's
    first chunk never borrows the decode's threads."""
    worker = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    assert worker.job_yield == JobYield()  # a CPU vocoder
    col, now = Collector(), 1000.0
    listener = ListenerClock()
    worker.feed([open_stream(setup, col, "job-new", setup.voices[0], 7, live=False, admitted_s=2.0),
                 final("job-new", utterance(40, seed=7), 40),
                 open_stream(setup, col, "job-old", setup.voices[0], 8, live=False, admitted_s=1.0),
                 final("job-old", utterance(40, seed=8), 40),
                 open_stream(setup, col, "turn", setup.voices[0], 9, listener, reproducible=False, admitted_s=3.0),
                 Feed("turn", tuple(utterance(3, seed=9)))])
    worker._drain(block=False)  # not started: driven by hand
    voice = setup.vocoder.prepare_voice(setup.voices[0].s3gen_ref)
    for speech in worker._speeches.values():
        worker._start_stream(speech, voice, setup.vocoder.prompt_cache(voice))

    def tick(on: VocoderWorker = worker) -> list[str]:
        return [speech.request_id for speech, _ in on._due(now)]

    assert tick() == []  # the turn has 3 of its first 6 tokens: the jobs wait for its first chunk
    worker.feed([Feed("turn", tuple(utterance(60, seed=10)))])
    worker._drain(block=False)
    assert tick() == ["turn"]
    worker._render(worker._due(now))  # the turn's first chunk
    listener.report(sent_audio_s=3.0, started_monotonic_s=now - 1.0)  # it holds 2 s, and 57 tokens are ready
    assert tick() == ["turn"]  # due: live first, and alone on a CPU
    listener.report(sent_audio_s=5.0, started_monotonic_s=now - 1.0)  # it holds 4 s: seconds to spare
    assert tick() == ["job-old"]  # a job chunk first, the oldest job's; the turn's in the next tick
    listener.report(sent_audio_s=3.0, started_monotonic_s=now - 1.0)  # 2 s again
    while tick() == ["turn"]:
        worker._render(worker._due(now))  # until too few of its tokens are ready for a chunk
    assert tick() == ["job-old"]  # nothing live due: one job chunk, the oldest job's
    assert not VocoderWorker._first_audio(worker._due(now), now)  # a job's first chunk borrows nothing
    listener.report(sent_audio_s=1.8, started_monotonic_s=now - 1.0)  # holds 0.8 s, nothing due: no job either
    assert tick() == []
    listener.report(sent_audio_s=3.0, started_monotonic_s=now - 1.0)  # holds 2 s
    assert tick() == ["job-old"]
    worker.job_tick_s = 1.1  # job ticks took 1.1 s lately: a listener holding 2 s is too little
    assert JOB_TICK_MARGIN_FACTOR * worker.job_tick_s > 2.0 and tick() == []
    worker.job_tick_s = 0.0
    job_old = worker._speeches["job-old"]

    gpu = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None,
                        job_yield=JobYield(max_job_streams=8, batch_with_live=True, stoppable=False))
    gpu._speeches, gpu._by_stream = worker._speeches, worker._by_stream
    assert tick(gpu) == ["job-old", "job-new"]
    worker.feed([Feed("turn", tuple(utterance(40, seed=11)))])
    worker._drain(block=False)  # 40 more tokens of the turn: due again, its listener holding 2 s
    assert tick(gpu) == ["turn", "job-old", "job-new"]
    listener.report(sent_audio_s=5.0, started_monotonic_s=now - 1.0)  # holds 4 s: after the jobs in the batch
    assert tick(gpu) == ["job-old", "job-new", "turn"]
    listener.report(sent_audio_s=1.5, started_monotonic_s=now - 1.0)  # holds 0.5 s: under the margin
    assert tick(gpu) == ["turn"]
    assert job_old.chunks_emitted == 0 and col.chunks("turn")


def test_a_stopped_render_leaves_its_streams_as_they_were(setup: Setup) -> None:
    """render_checkpoints: a render stopped at any of its stage boundaries (encoder layers, Euler steps, HiFT's
    levels) raises RenderInterrupted and applies nothing to its streams; rendering them afterwards gives the same
    bits as streams never stopped."""
    vocoder = setup.vocoder
    voice = vocoder.prepare_voice(setup.voices[0].s3gen_ref)
    tokens = utterance(40, seed=12)

    def opened(seed: int) -> VocoderStream:
        stream = vocoder.open(voice, seed=seed)
        stream.prompt = vocoder.prompt_cache(voice)
        stream.add(tokens, final=True)
        return stream

    def state(stream: VocoderStream) -> tuple[object, ...]:
        return (stream.mel_tokens, stream.emitted_samples, stream.finished,
                *(None if a is None else a.tobytes() for a in (stream.held_mel, stream.held_source, stream.held_wav)))

    def chunks(streams: list[VocoderStream]) -> list[RenderJob]:
        return [job for stream in streams if (job := stream.next_job(16)) is not None]

    passed = [0]

    def stop_at(checkpoint: int) -> Callable[[], bool]:  # stops at that checkpoint (0: never), counting them
        def should_stop() -> bool:
            passed[0] += 1
            return passed[0] == checkpoint
        passed[0] = 0
        return should_stop

    reference = [opened(seed) for seed in (21, 22)]
    expected: list[list[Pcm]] = [[], []]
    while jobs := chunks(reference):
        for index, pcm_out in enumerate(vocoder.render(jobs)):
            expected[index].append(pcm_out)
    with stop_when(stop_at(0)):
        vocoder.render(chunks([opened(seed) for seed in (21, 22)]))
    checkpoints = passed[0]
    assert checkpoints >= 20  # (10 Euler steps, the encoder's layers, HiFT's levels and blocks)
    streams = [opened(seed) for seed in (21, 22)]
    got: list[list[Pcm]] = [[], []]
    for at in (1, checkpoints // 2, checkpoints):  # the encoder's first layer, mid-way, HiFT's last block
        before = [state(stream) for stream in streams]
        jobs = chunks(streams)
        with pytest.raises(RenderInterrupted), stop_when(stop_at(at)):
            vocoder.render(jobs)
        assert [state(stream) for stream in streams] == before
        for index, pcm_out in enumerate(vocoder.render(jobs)):
            got[index].append(pcm_out)
    while jobs := chunks(streams):
        for index, pcm_out in enumerate(vocoder.render(jobs)):
            got[index].append(pcm_out)
    for want, have in zip(expected, got, strict=True):
        assert np.concatenate(have).tobytes() == np.concatenate(want).tobytes()


def _worker_with_a_job(setup: Setup) -> tuple[VocoderWorker, Collector, VocoderVoice]:
    """A worker (not started: the test drives it) holding one job segment's stream, its 40 tokens all in, ready to
    render; its collector and the prepared voice."""
    worker = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    col = Collector()
    worker.feed([open_stream(setup, col, "job", setup.voices[0], 7, live=False), final("job", utterance(40, 7), 40)])
    worker._drain(block=False)
    voice = setup.vocoder.prepare_voice(setup.voices[0].s3gen_ref)
    worker._start_stream(worker._speeches["job"], voice, setup.vocoder.prompt_cache(voice))
    return worker, col, voice


def test_a_job_render_stops_when_a_live_turn_opens_or_a_live_listener_runs_low(setup: Setup) -> None:
    """On a CPU a job tick's render stops at its next stage boundary once a live turn's stream is fed (the engine
    thread's `feed`), or once a live listener holds less than JobYield.stop_below_s; nothing of it reaches the job's
    outlet, and the job renders that chunk later. A live tick is never stopped."""
    worker, col, voice = _worker_with_a_job(setup)
    job_tick = worker._due(time.monotonic())
    assert [speech.request_id for speech, _ in job_tick] == ["job"]
    turn = ListenerClock()
    worker.feed([open_stream(setup, col, "turn", setup.voices[0], 9, turn, reproducible=False),
                 Feed("turn", tuple(utterance(3, seed=9)))])  # the engine thread: a live turn's first ids
    worker._render(job_tick)
    assert worker.job_renders_stopped == 1 and not col.chunks("job") and worker.ticks == 0
    worker._drain(block=False)  # (clears the flag) the turn now holds the jobs back until its first chunk
    worker._start_stream(worker._speeches["turn"], voice, setup.vocoder.prompt_cache(voice))
    assert worker._due(time.monotonic()) == []
    worker._forget("turn")
    worker._render(worker._due(time.monotonic()))  # the same job chunk, rendered to the end now
    assert worker.job_renders_stopped == 1 and [c.seq for c in col.chunks("job")] == [0]

    low = ListenerClock()
    worker.feed([open_stream(setup, col, "low", setup.voices[0], 10, low, reproducible=False),
                 Feed("low", tuple(utterance(30, seed=10)))])
    worker._drain(block=False)
    worker._start_stream(worker._speeches["low"], voice, setup.vocoder.prompt_cache(voice))
    worker._render(worker._due(time.monotonic()))  # its first chunk: a live tick
    low.report(sent_audio_s=3.0, started_monotonic_s=time.monotonic())  # holds 3 s
    job_tick = [(speech, job) for speech, job in worker._due(time.monotonic()) if not speech.spec.live]
    while not job_tick:  # (the live stream's due chunks first)
        worker._render(worker._due(time.monotonic()))
        job_tick = [(speech, job) for speech, job in worker._due(time.monotonic()) if not speech.spec.live]
    low.report(sent_audio_s=0.1, started_monotonic_s=time.monotonic())  # now it holds 0.1 s
    worker._render(job_tick)
    assert worker.job_renders_stopped == 2 and [c.seq for c in col.chunks("job")] == [0]


def test_a_job_render_stops_for_a_later_segment_whose_listener_runs_low(setup: Setup) -> None:
    """A turn's later segment (its listener has reported: it plays the segments before) counts before its first
    chunk: a job render stops when that listener falls under JobYield.stop_below_s while the segment's stream is
    open with no chunk due yet; and a segment whose stream opens mid-render (fed by the engine thread) with its
    listener under the jobs' margin stops it too (had the worker known of it, the job tick would not have
    started)."""
    worker, col, voice = _worker_with_a_job(setup)
    listener = ListenerClock()
    listener.report(sent_audio_s=3.0, started_monotonic_s=time.monotonic())  # the session's listener holds 3 s
    worker.feed([open_stream(setup, col, "second", setup.voices[0], 9, listener, reproducible=False),
                 Feed("second", tuple(utterance(3, seed=9)))])  # 3 ids: no chunk due yet
    worker._drain(block=False)
    worker._start_stream(worker._speeches["second"], voice, setup.vocoder.prompt_cache(voice))
    job_tick = worker._due(time.monotonic())
    assert [speech.request_id for speech, _ in job_tick] == ["job"]  # 3 s held: the job may render
    listener.report(sent_audio_s=0.1, started_monotonic_s=time.monotonic())  # now it holds 0.1 s
    worker._render(job_tick)
    assert worker.job_renders_stopped == 1 and not col.chunks("job")

    worker._forget("second")
    worker._drain(block=False)
    job_tick = worker._due(time.monotonic())  # no live stream known: the job tick starts
    assert [speech.request_id for speech, _ in job_tick] == ["job"]
    worker.feed([open_stream(setup, col, "third", setup.voices[0], 11, listener, reproducible=False),
                 Feed("third", tuple(utterance(20, seed=11)))])  # the engine thread, mid-render; 0.1 s held
    worker._render(job_tick)
    assert worker.job_renders_stopped == 2 and not col.chunks("job")


def test_feeds_wait_when_the_worker_is_far_behind(setup: Setup) -> None:
    """The feed queue is bounded in decode steps: with the worker not draining, the bound is used up (proved by
    the slot count, not by waiting), and a drain frees it."""
    idle = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=1, on_sink_failed=lambda rid: None,
                         max_pending_steps=2)
    idle.feed([Feed("a", (1,))])
    idle.feed([Feed("a", (2,))])
    assert not idle._feed_slots.acquire(blocking=False)  # a third feed would wait
    idle._drain(block=False)
    assert idle._feed_slots.acquire(blocking=False)


def test_a_turns_first_audio_is_what_borrows_the_decodes_threads(setup: Setup) -> None:
    """CoreLease's `urgent`: a tick with a segment's first chunk for a listener that has been sent nothing (a
    turn's first audio); not a later chunk, not a later segment's first chunk (dry or not)."""
    col, now = Collector(), 1000.0
    fresh, holding, dry = ListenerClock(), ListenerClock(), ListenerClock()
    holding.report(sent_audio_s=3.0, started_monotonic_s=now - 1.0)  # holds 2 s
    dry.report(sent_audio_s=1.0, started_monotonic_s=now - 2.0)  # ran dry 1 s ago

    def speech(rid: str, listener: ListenerClock | None, chunks: int) -> Speech:
        state = Speech(spec=open_stream(setup, col, rid, setup.voices[0], 1, listener, reproducible=False))
        state.chunks_emitted = chunks
        return state

    job = cast(RenderJob, None)  # the decision reads the streams only
    later = speech("later", None, 2)
    later.emitted_s, later.first_chunk_s = 0.5, now - 1.0  # its own chunks ran out
    assert VocoderWorker._first_audio([(speech("no clock", None, 0), job)], now)
    assert VocoderWorker._first_audio([(later, job), (speech("turn", fresh, 0), job)], now)
    assert not VocoderWorker._first_audio([(later, job)], now)  # dry, but past its first chunk
    assert not VocoderWorker._first_audio([(speech("after a gap", dry, 0), job)], now)
    assert not VocoderWorker._first_audio([(speech("next sentence", holding, 0), job)], now)


def test_debug_log_says_what_each_render_tick_did(setup: Setup, worker: VocoderWorker,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """At debug level every tick is one log line: its streams, each one's chunk index and tokens rendered, the
    threads it ran with and its milliseconds (`--log-level debug`: where a slow first audio's time went)."""
    col = Collector()
    tokens = utterance(20, seed=4)
    with caplog.at_level("DEBUG", logger="synth.vocoder_worker"):
        worker.feed([open_stream(setup, col, "logged", setup.voices[0], seed=5), final("logged", tokens, 20)])
        col.wait_done(["logged"])
    ticks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("render tick")]
    assert ticks[0].startswith("render tick: 1 streams, ") and " 1 threads, logged#0:" in ticks[0]
    assert sum(int(t.split(":")[-1].split("t/")[0]) for t in ticks) == 20  # each token's mel frames rendered once


def test_graphs_of_first_chunks_are_built_before_the_first_listener(setup: Setup) -> None:
    """`warm_graphs` (the engine's start-up with the vocoder's graphs on) captures, on the worker thread, the
    first-chunk tick of 1, 2, 4 ... max_batch streams; a real tick of first chunks then meets only those
    signatures (no capture while a listener waits for its first audio). Without graphs it builds nothing; a
    voice the worker has not prepared builds nothing either."""
    graphed = StreamingVocoder(setup.vocoder.s3gen, n_cfm_timesteps=10, meanflow=False,
                               prompt_max_tokens=PROMPT_TOKENS, max_chunk_tokens=16)
    graphs = graphed.use_graphs(capture=False)  # the CPU: the same signatures, no capture
    worker = VocoderWorker(graphed, POLICY, threads=1, max_batch=4, on_sink_failed=lambda rid: None)
    worker.start()
    try:
        worker.prepare_voice(setup.voices[0])
        assert worker.wait_prepared([setup.voices[0].key], 120)
        assert worker.warm_graphs("no-such-voice", 60) == 0
        built = worker.warm_graphs(setup.voices[0].key, 120)
        assert built == 3 * 3 == graphs.captured  # encoder, estimator step, HiFT x batches 1, 2, 4
    finally:
        worker.stop()
    voice = graphed.prepare_voice(setup.voices[1].s3gen_ref)  # another voice: the same shapes
    streams = []
    for seed in range(3):  # three first chunks: a batch of 3, padded to 4
        stream = graphed.open(voice, seed=seed)
        stream.prompt = graphed.prompt_cache(voice)
        stream.add(utterance(40, seed=seed), final=False)
        streams.append(stream)
    jobs = [stream.next_job(POLICY.first_chunk_tokens) for stream in streams]
    assert all(out.size > 0 for out in graphed.render([job for job in jobs if job is not None]))
    assert graphs.captured == built
    assert setup.vocoder.warm_first_chunks(voice, POLICY.first_chunk_tokens, 4) == 0  # no graphs: nothing to do


def test_a_job_render_stops_and_no_job_starts_while_a_live_turn_is_on_its_way_from_t3(setup: Setup) -> None:
    """Before a live turn's stream opens (submitted, queued, prefilling: `turn_pending`, the engine's), a job tick's
    render stops at its next stage boundary and no job chunk is due, so that the decode may borrow the idle vocoder's
    threads for the turn's prefill and first ids. Once nothing is pending the job renders that chunk, to the bits it
    renders never stopped."""
    worker, col, voice = _worker_with_a_job(setup)
    job_tick = worker._due(time.monotonic())
    assert [speech.request_id for speech, _ in job_tick] == ["job"]
    asked = [0]

    def pending_from_the_third_boundary() -> bool:  # a turn submitted while the job's render runs
        asked[0] += 1
        return asked[0] >= 3

    worker.turn_pending = pending_from_the_third_boundary
    worker._render(job_tick)
    assert worker.job_renders_stopped == 1 and not col.chunks("job") and worker.ticks == 0 and asked[0] == 3
    assert worker._due(time.monotonic()) == []  # still pending: no job chunk starts
    worker.turn_pending = lambda: False  # the turn's stream opened (or it ended)
    worker._render(worker._due(time.monotonic()))
    assert worker.job_renders_stopped == 1 and [c.seq for c in col.chunks("job")] == [0]

    reference = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=8, on_sink_failed=lambda rid: None)
    ref_col = Collector()
    reference.feed([open_stream(setup, ref_col, "job", setup.voices[0], 7, live=False),
                    final("job", utterance(40, 7), 40)])
    reference._drain(block=False)
    reference._start_stream(reference._speeches["job"], voice, setup.vocoder.prompt_cache(voice))
    reference._render(reference._due(time.monotonic()))
    assert col.chunks("job")[0].pcm.tobytes() == ref_col.chunks("job")[0].pcm.tobytes()

    # on a GPU nothing borrows the vocoder's threads: a pending turn holds no job chunk back
    gpu_policy = JobYield.for_device(torch.device("cuda"), 8)
    assert not gpu_policy.hold_for_turns and JobYield().hold_for_turns
    reference.job_yield = gpu_policy
    reference.turn_pending = lambda: True
    assert [speech.request_id for speech, _ in reference._due(time.monotonic())] == ["job"]


def test_every_tensor_of_a_prepared_voice_and_its_prompt_cache_is_marked_used_on_the_render_stream(
        setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """A voice is prepared on the preparation thread's CUDA stream and read on the worker's: each of its tensors (the
    prompt cache's nested ones included) gets `record_stream(worker stream)`, so that a block freed later is not
    reused by the preparer while renders queued on the worker's stream still read it. (The CPU has no streams: the
    walk is checked with record_stream recorded.)"""
    marked: list[int] = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, stream: marked.append(id(tensor)))
    voice = setup.vocoder.prepare_voice(setup.voices[0].s3gen_ref)
    prompt = setup.vocoder.prompt_cache(voice)
    assert prompt is not None
    worker = VocoderWorker(setup.vocoder, POLICY, threads=1, max_batch=2, on_sink_failed=lambda rid: None)
    worker._render_stream = object()  # as on CUDA
    worker._voice_ready(_VoiceReady(setup.voices[0].key, voice, prompt))
    expected = [voice.prompt_tokens, voice.prompt_mels, voice.prompt_noise, voice.speaker, prompt.encoder.mu,
                *prompt.encoder.layer_kv, *(key for step in prompt.steps for key in step.keys),
                *(value for step in prompt.steps for value in step.values)]
    assert {id(tensor) for tensor in expected} <= set(marked)
