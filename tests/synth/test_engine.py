"""Engine behaviour with the streaming vocoder on: audio determinism, cancel, isolation, lifecycle."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import NoReturn

import numpy as np
import numpy.typing as npt
import pytest
import torch

from synth.api import (
    SAMPLES_PER_SPEECH_TOKEN,
    AudioChunk,
    EngineError,
    EventKind,
    SamplingParams,
    SegmentRequest,
    Variant,
)
from synth.build import S3GEN_SILENCE_TOKENS_TURBO
from synth.cpu_threads import BorrowGain
from synth.engine import Engine
from synth.loading import ModelBundle
from synth.request import SPEECH_VOCAB_SIZE
from synth.vocoder import VocoderVoice
from synth.voices import Voice

from tests.synth.conftest import TEST_DEVICE, Collector, make_engine, synthetic_voice, tiny_bundle
from tests.synth.op_counter import count_ops

TEXTS = ["Hello world, this is a test.", "Another sentence to speak!", "Short one.", "A fourth, different text.",
         "Fifth text here please.", "Number six is on its way.", "Seven, the lucky one.", "Eight and done."]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = make_engine("english", render_audio=True, max_slots=8, first_chunk_tokens=6,
                      chunk_schedule_tokens=(8, 16))
    bundle = tiny_bundle("english")
    from synth import default_voice

    eng.voices.add(default_voice(bundle))
    eng.voices.add(replace(default_voice(bundle), voice_id="other", builtin=False,
                           speaker_emb=synthetic_voice(bundle, "x", 3).speaker_emb))
    eng.start()
    assert eng.wait_ready(120)
    yield eng
    eng.stop()


def _request(collector: Collector, rid: str, text: str, seed: int, n_tokens: int = 30,
             voice: str = "default", **kw: object) -> SegmentRequest:
    params = replace(SamplingParams.defaults("english"), seed=seed, max_new_tokens=n_tokens)
    return SegmentRequest(request_id=rid, text=text, voice_id=voice, params=params, sink=collector.sink_for(rid),
                          **kw)  # type: ignore[arg-type]


def _pcm(collector: Collector, rid: str) -> npt.NDArray[np.float32]:
    chunks = collector.chunks(rid)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    return np.concatenate([c.pcm for c in chunks]) if chunks else np.zeros(0, np.float32)


def test_seeded_pcm_identical_alone_and_in_a_batch_of_8(engine: Engine) -> None:
    alone = Collector()
    engine.submit(_request(alone, "alone", TEXTS[0], seed=42))
    alone.wait_done(["alone"])
    batch = Collector()
    ids = [f"b{i}" for i in range(8)]
    for i, rid in enumerate(ids):  # the seeded one sits in the middle of the batch
        seed = 42 if i == 3 else 500 + i
        engine.submit(_request(batch, rid, TEXTS[0] if i == 3 else TEXTS[i], seed=seed,
                               voice="other" if i % 2 else "default"))
    batch.wait_done(ids)
    assert batch.tokens("b3") == alone.tokens("alone")
    a, b = _pcm(alone, "alone"), _pcm(batch, "b3")
    assert a.size > 0 and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert not np.array_equal(a, _pcm(batch, "b0")[: a.size])


def test_total_samples_are_960_per_valid_token(engine: Engine) -> None:
    col = Collector()
    engine.submit(_request(col, "count", TEXTS[1], seed=9, n_tokens=50))
    col.wait_done(["count"])
    valid = [t for t in col.tokens("count") if t < SPEECH_VOCAB_SIZE]
    chunks = col.chunks("count")
    assert len(chunks) >= 3  # first chunk small, then the schedule
    assert sum(c.speech_tokens for c in chunks) == len(valid)
    assert _pcm(col, "count").size == SAMPLES_PER_SPEECH_TOKEN * len(valid)
    assert col.kinds("count") == [EventKind.STARTED, EventKind.GENERATED, EventKind.DONE]


def test_cancel_frees_the_slot_and_stops_chunks(engine: Engine) -> None:
    col = Collector()
    engine.submit(_request(col, "long", TEXTS[2], seed=5, n_tokens=400))
    deadline = time.monotonic() + 60
    while not col.chunks("long"):
        assert time.monotonic() < deadline
        time.sleep(0.002)
    engine.cancel("long")
    after_cancel = len(col.chunks("long"))
    col.wait_done(["long"])
    assert col.kinds("long")[-1] == EventKind.CANCELLED
    # a request submitted after the cancel runs to its end: the engine stepped on since, so a chunk of
    # "long" that could still come would have come (a count, not a sleep, proves the negative)
    engine.submit(_request(col, "after", TEXTS[0], seed=6, n_tokens=20))
    col.wait_done(["after"])
    assert col.kinds("after")[-1] == EventKind.DONE
    assert len(col.chunks("long")) == after_cancel
    assert not engine.scheduler.running  # the cancelled slot was freed (and "after" finished)
    # and the runner holds no voice prefix for rows nobody uses (a removed voice's prefix must be freeable)
    assert engine.runner.row_prefixes.holding() == []


def test_busy_when_no_slot_and_request_may_not_wait(engine: Engine) -> None:
    col = Collector()
    ids = [f"fill{i}" for i in range(8)]
    for i, rid in enumerate(ids):
        engine.submit(_request(col, rid, TEXTS[i], seed=i, n_tokens=300))
    for rid in ids:
        col.wait_kind(rid, EventKind.STARTED)
    engine.submit(_request(col, "refused", TEXTS[0], seed=1, may_wait=False))
    col.wait_done(["refused"])
    assert col.kinds("refused") == [EventKind.BUSY]
    for rid in ids:
        engine.cancel(rid)
    col.wait_done(ids)


def test_bad_requests_raise_at_submit(engine: Engine) -> None:
    col = Collector()
    with pytest.raises(EngineError, match="unknown voice"):
        engine.submit(_request(col, "x", "hi", seed=1, voice="nope"))
    with pytest.raises(EngineError, match="temperature"):
        engine.submit(SegmentRequest(request_id="y", text="hi", sink=col.sink_for("y"),
                                     params=SamplingParams(temperature=0.0)))
    with pytest.raises(EngineError, match="empty"):
        engine.submit(_request(col, "z", "   ", seed=1))


def test_a_sink_that_raises_ends_only_its_own_segment(engine: Engine) -> None:
    col = Collector()

    def bad_sink(out: object) -> None:
        if isinstance(out, AudioChunk):
            raise RuntimeError("client went away")

    engine.submit(SegmentRequest(request_id="bad", text=TEXTS[3], sink=bad_sink,
                                 params=replace(SamplingParams(), seed=3, max_new_tokens=200)))
    engine.submit(_request(col, "good", TEXTS[4], seed=4, n_tokens=40))
    col.wait_done(["good"])
    assert col.kinds("good")[-1] == EventKind.DONE
    deadline = time.monotonic() + 30
    while any(s.request_id == "bad" for s in engine.scheduler.running):
        assert time.monotonic() < deadline, "the failing segment kept its slot"
        time.sleep(0.01)
    assert engine.alive


def test_a_sink_that_calls_back_into_the_engine_fails_alone_instead_of_deadlocking(engine: Engine) -> None:
    """A sink runs under the engine's emit lock: a submit from it (the engine thread's STARTED) or a cancel from it
    (the vocoder thread's audio) used to wait for that lock forever, with the engine thread or the vocoder in it.
    Now it raises SinkReentryError in the sink, the outlet reports a sink that raised, and only that request ends."""
    col = Collector()
    errors: list[BaseException] = []
    called = threading.Event()

    def calling_sink(rid: str) -> Callable[[object], None]:
        def sink(out: object) -> None:
            kind = getattr(out, "kind", None)
            if kind == EventKind.STARTED or isinstance(out, AudioChunk):
                called.set()
                try:
                    if kind == EventKind.STARTED:
                        engine.submit(_request(col, f"{rid}-from-sink", TEXTS[1], seed=9))
                    else:
                        engine.cancel(rid)
                except EngineError as error:
                    errors.append(error)
                    raise
        return sink

    for rid, text in (("submits", TEXTS[5]), ("cancels", TEXTS[6])):
        params = replace(SamplingParams(), seed=5, max_new_tokens=200)
        if rid == "cancels":  # its STARTED goes through: it calls back from the vocoder's thread
            engine.submit(SegmentRequest(request_id=rid, text=text, sink=_audio_only(calling_sink(rid)), params=params))
        else:
            engine.submit(SegmentRequest(request_id=rid, text=text, sink=calling_sink(rid), params=params))
    engine.submit(_request(col, "bystander", TEXTS[7], seed=7, n_tokens=40))
    col.wait_done(["bystander"], timeout_s=60)  # times out if the engine thread deadlocked
    assert called.is_set()
    assert col.kinds("bystander")[-1] == EventKind.DONE
    assert len(errors) == 2 and all(type(e).__name__ == "SinkReentryError" for e in errors), errors
    assert "emit lock" in str(errors[0])
    assert not engine.has_request("submits-from-sink")
    deadline = time.monotonic() + 30
    while any(s.request_id in ("submits", "cancels") for s in engine.scheduler.running):
        assert time.monotonic() < deadline, "a segment whose sink called back kept its slot"
        time.sleep(0.01)
    assert engine.alive


def _audio_only(sink: Callable[[object], None]) -> Callable[[object], None]:
    """`sink` sees only the audio chunks."""
    def audio_sink(out: object) -> None:
        if isinstance(out, AudioChunk):
            sink(out)
    return audio_sink


def test_engine_failure_fails_segments_and_turns_not_ready() -> None:
    eng = make_engine("english", render_audio=False, max_slots=2)
    eng.voices.add(synthetic_voice(tiny_bundle("english"), "default", 1))
    eng.start()
    assert eng.wait_ready(60)
    col = Collector()
    fired = threading.Event()
    original = eng.runner.decode

    def broken_decode(*args: object, **kwargs: object) -> NoReturn:
        fired.set()
        raise RuntimeError("simulated CUDA error")

    eng.runner.decode = broken_decode  # type: ignore[method-assign]
    try:
        eng.submit(_request(col, "victim", TEXTS[0], seed=1, n_tokens=50))
        col.wait_done(["victim"])
        assert fired.is_set()
        assert col.kinds("victim")[-1] == EventKind.FAILED
        assert not eng.alive and not eng.ready and "simulated" in eng.failure
        with pytest.raises(EngineError):
            eng.submit(_request(col, "late", TEXTS[0], seed=1))
    finally:
        eng.runner.decode = original  # type: ignore[method-assign]
        eng.stop()


def test_text_longer_than_the_cache_is_refused_at_submit_not_in_the_engine() -> None:
    eng = make_engine("english", render_audio=False, max_slots=1, max_context_tokens=128)
    eng.voices.add(synthetic_voice(tiny_bundle("english"), "default", 1))
    col = Collector()
    with pytest.raises(EngineError, match="too long"):
        eng.submit(_request(col, "long", "word " * 40, seed=1))
    eng.submit(_request(col, "ok", "short text", seed=1, n_tokens=5))  # fits: accepted


def test_derived_kv_length_fits_the_longest_segment() -> None:
    from synth.api import HARD_MAX_NEW_TOKENS, MAX_SEGMENT_TEXT_TOKENS

    cases: tuple[tuple[Variant, int], ...] = (("english", 34), ("turbo", 376))
    for variant, prefix in cases:
        eng = make_engine(variant, render_audio=False, max_slots=1, max_context_tokens=0)
        assert eng.prefix_positions == prefix
        # the conditioning is a shared prefix, not part of the slot: a slot holds text + BOS block + speech
        assert eng.runner.cache.usable_len >= MAX_SEGMENT_TEXT_TOKENS + 2 + HARD_MAX_NEW_TOKENS
        assert eng.max_text_positions >= MAX_SEGMENT_TEXT_TOKENS
        assert eng.runner.cache.max_len % 64 == 0


def _swap_voices(bundle: ModelBundle, n: int) -> list[dict[str, object]]:
    """Conditioning for n cloned voices whose T3 and S3Gen conditioning both differ."""
    from synth import default_voice

    base = default_voice(bundle)
    voices: list[dict[str, object]] = []
    for cycle in range(n):
        noise = torch.randn(base.s3gen_ref["embedding"].shape, generator=torch.Generator().manual_seed(cycle))
        ref = {**base.s3gen_ref, "embedding": base.s3gen_ref["embedding"] + noise.to(base.s3gen_ref["embedding"])}
        voices.append({"speaker_emb": synthetic_voice(bundle, "x", 100 + cycle).speaker_emb,
                       "prompt_speech_tokens": base.prompt_speech_tokens, "s3gen_ref": ref})
    return voices


def test_a_voice_removed_and_re_added_under_its_id_speaks_with_its_new_conditioning(engine: Engine) -> None:
    # Whether CPython gives the new object the freed one's address depends on its allocator's pool order, so
    # cycle until it has happened twice (about every other cycle here); the bug needs that reuse to show.
    conditioning = _swap_voices(tiny_bundle("english"), 16)
    swapped: list[tuple[list[int], npt.NDArray[np.float32]]] = []
    addresses: set[int] = set()
    for cycle, fields in enumerate(conditioning):
        if len(swapped) - len(addresses) >= 2:  # reuses so far
            break
        voice = Voice(voice_id="swap", **fields)  # type: ignore[arg-type]
        addresses.add(id(voice))
        engine.voices.add(voice)
        col = Collector()
        engine.submit(_request(col, f"swap{cycle}", TEXTS[5], seed=77, n_tokens=24, voice="swap"))
        col.wait_done([f"swap{cycle}"])
        swapped.append((col.tokens(f"swap{cycle}"), _pcm(col, f"swap{cycle}")))
        engine.remove_voice("swap")
        deadline = time.monotonic() + 30
        while sys.getrefcount(voice) > 2:  # the engine thread lets go of its segment (and so of the voice)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        del voice  # freed now: the next Voice is allocated at its address, which id()-keyed caches confuse
    assert len(swapped) - len(addresses) >= 2, "addresses were not reused: the test proves nothing this run"
    conditioning = conditioning[:len(swapped)]
    # the truth: a fresh engine (empty caches) holding all those voices at once, under their own ids
    fresh = make_engine("english", render_audio=True, max_slots=4, first_chunk_tokens=6, chunk_schedule_tokens=(8, 16))
    for cycle, fields in enumerate(conditioning):
        fresh.voices.add(Voice(voice_id=f"v{cycle}", **fields))  # type: ignore[arg-type]
    fresh.start()
    try:
        assert fresh.wait_ready(120)
        col = Collector()
        for cycle in range(len(swapped)):
            fresh.submit(_request(col, f"v{cycle}", TEXTS[5], seed=77, n_tokens=24, voice=f"v{cycle}"))
        col.wait_done([f"v{cycle}" for cycle in range(len(swapped))])
        for cycle, (tokens, pcm) in enumerate(swapped):
            assert tokens == col.tokens(f"v{cycle}"), f"cycle {cycle}: T3 used another voice's prefix"
            assert np.array_equal(pcm, _pcm(col, f"v{cycle}")), f"cycle {cycle}: S3Gen used another voice's prompt"
        assert len({pcm.tobytes() for _, pcm in swapped}) == len(swapped)  # the voices really differ
    finally:
        fresh.stop()


def _run_sequence(engine: Engine, delays_s: list[float]) -> dict[str, tuple[list[int], npt.NDArray[np.float32]]]:
    """The same sequence of calls, with the given pauses between them: three seeded segments on the default
    voice, a voice uploaded while they speak, two seeded segments on it (and one more on the default)."""
    from synth.presets import synthetic_reference_wav

    col = Collector()
    ids = []

    def submit(rid: str, text: str, seed: int, voice: str = "default") -> None:
        engine.submit(_request(col, rid, text, seed=seed, n_tokens=40, voice=voice))
        ids.append(rid)

    pause = iter(delays_s)
    for i in range(3):
        submit(f"d{i}", TEXTS[i], seed=300 + i)
        time.sleep(next(pause))
    engine.add_voice("uploaded", synthetic_reference_wav(24_000, seconds=6.0, seed=77), 24_000)
    time.sleep(next(pause))
    submit("u0", TEXTS[3], seed=400, voice="uploaded")
    time.sleep(next(pause))
    submit("u1", TEXTS[4], seed=401, voice="uploaded")
    submit("d3", TEXTS[5], seed=303)
    col.wait_done(ids, timeout_s=300)
    return {rid: (col.tokens(rid), _pcm(col, rid)) for rid in ids}


def test_two_fresh_engines_fed_the_same_sequence_give_bit_identical_pcm() -> None:
    """Same calls, other timing and other batching (one engine renders up to 8 streams per vocoder tick, the
    other one at a time, and their calls come at other moments), a voice uploaded mid-stream: the same tokens
    and bit-identical PCM for every seeded segment."""
    runs = []
    for max_batch, delays in ((8, [0.0, 0.0, 0.0, 0.0, 0.0]), (1, [0.05, 0.2, 0.0, 0.3, 0.1])):
        engine = make_engine("english", render_audio=True, max_slots=8, first_chunk_tokens=6,
                             chunk_schedule_tokens=(8, 16), vocoder_max_batch=max_batch)
        from synth import default_voice

        engine.voices.add(default_voice(tiny_bundle("english")))
        engine.start()
        try:
            assert engine.wait_ready(120)
            runs.append(_run_sequence(engine, delays))
        finally:
            engine.stop()
    first, second = runs
    assert set(first) == set(second)
    for rid in first:
        assert first[rid][0] == second[rid][0], rid
        assert first[rid][1].size > 0 and np.array_equal(first[rid][1], second[rid][1]), rid


def test_adding_a_voice_while_four_streams_speak_stalls_none_of_them(engine: Engine) -> None:
    """A voice is uploaded and its vocoder preparation held (it takes ~10 s for English on a CPU); four segments
    submitted meanwhile are decoded, rendered and finished while it is still held, and add_voice returned at
    once. Counted: the decode steps run during the hold (at least each segment's tokens). The preparation's
    only share of the decode thread is the voice's T3 prefix (one 34-position forward, about one prefill)."""
    from synth.presets import synthetic_reference_wav

    vocoder = engine.vocoder
    started, release = threading.Event(), threading.Event()
    original: Callable[[dict[str, object]], VocoderVoice] = vocoder.prepare_voice
    uploaded: dict[str, object] = {}

    def held(ref: dict[str, object]) -> VocoderVoice:
        if ref is uploaded.get("ref"):
            started.set()
            assert release.wait(300)
        return original(ref)

    original_add = engine.voices.add

    def remember(voice: Voice) -> None:
        uploaded["ref"] = voice.s3gen_ref
        return original_add(voice)

    vocoder.prepare_voice = held
    engine.voices.add = remember  # type: ignore[method-assign]
    try:
        engine.add_voice("late", synthetic_reference_wav(24_000, seconds=6.0, seed=5), 24_000)
        assert started.wait(60)
        steps_before = engine.steps
        col = Collector()
        ids = [f"talk{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            engine.submit(_request(col, rid, TEXTS[i], seed=900 + i, n_tokens=60))
        col.wait_done(ids)
        assert not release.is_set()  # the preparation is still held
        for rid in ids:
            assert col.kinds(rid) == [EventKind.STARTED, EventKind.GENERATED, EventKind.DONE]
            valid = [t for t in col.tokens(rid) if t < SPEECH_VOCAB_SIZE]
            assert _pcm(col, rid).size == SAMPLES_PER_SPEECH_TOKEN * len(valid)
        assert engine.steps - steps_before >= max(len(col.tokens(rid)) for rid in ids)
        engine.submit(_request(col, "on-late", TEXTS[6], seed=1, n_tokens=20, voice="late"))
        release.set()
        col.wait_done(["on-late"])
        assert col.kinds("on-late")[-1] == EventKind.DONE and _pcm(col, "on-late").size > 0
    finally:
        release.set()
        del vocoder.prepare_voice
        del engine.voices.add
        engine.remove_voice("late")


@pytest.mark.parametrize("variant", ["english", "turbo"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_speaks_a_segment_to_the_end(variant: Variant, dtype: str) -> None:
    """Conditioning, prefixes and KV cache in the runner's dtype; logits, sampling and the vocoder in fp32.
    (Before the fix, the fp32 T3Cond met a bf16 T3: "mat1 and mat2 must have the same dtype".)"""
    from synth import default_voice
    from synth.loading import random_bundle

    bundle = random_bundle(variant, "tiny", torch.device("cpu"))  # the runner casts its T3 in place
    eng = make_engine(variant, render_audio=True, max_slots=2, bundle=bundle, dtype=dtype,
                      first_chunk_tokens=6, chunk_schedule_tokens=(8, 16))
    eng.voices.add(default_voice(bundle))
    eng.start()
    try:
        assert eng.wait_ready(120), eng.failure
        assert eng.runner.cache.keys[0].dtype == getattr(torch, dtype)
        assert all(p.keys[0].dtype == getattr(torch, dtype) for p in eng.runner._prefixes.values())
        col = Collector()
        params = replace(SamplingParams.defaults(variant), seed=11, max_new_tokens=20)
        eng.submit(SegmentRequest(request_id="half", text=TEXTS[0], params=params, sink=col.sink_for("half")))
        col.wait_done(["half"])
        assert col.kinds("half") == [EventKind.STARTED, EventKind.GENERATED, EventKind.DONE]
        valid = [t for t in col.tokens("half") if t < SPEECH_VOCAB_SIZE]
        silence = S3GEN_SILENCE_TOKENS_TURBO if variant == "turbo" else 0  # Turbo's S3Gen appends 3 silent tokens
        assert valid and _pcm(col, "half").size == SAMPLES_PER_SPEECH_TOKEN * (len(valid) + silence)
    finally:
        eng.stop()


def test_a_warm_up_that_fails_leaves_the_engine_not_ready_with_the_reason() -> None:
    """Warm-up speaks a real segment; a failure anywhere on its path (here: the first decode step) is the
    engine's failure: never ready, dead, and the reason in `failure` and status()."""
    eng = make_engine("english", render_audio=False, max_slots=2)
    eng.voices.add(synthetic_voice(tiny_bundle("english"), "default", 1))

    def broken_decode(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("simulated: no kernel for this dtype")

    eng.runner.decode = broken_decode  # type: ignore[method-assign]
    eng.start()
    try:
        assert not eng.wait_ready(60)
        assert not eng.ready and not eng.alive
        assert "no kernel for this dtype" in eng.failure
        assert "no kernel for this dtype" in str(eng.status()["failure"])
    finally:
        eng.stop()


def _ops_per_decode_step(variant: str, sessions: int, voices: int, compact: bool) -> Counter[str]:
    """The aten ops of one steady-state engine step (every segment decoding, none admitted), driven on this
    thread (the engine thread is not started)."""
    eng = make_engine(variant, render_audio=False, max_slots=8, compact_steps=compact)  # type: ignore[arg-type]
    assert eng.runner.compact_rows == (compact and TEST_DEVICE == "cpu")
    bundle = tiny_bundle(variant)  # type: ignore[arg-type]
    for v in range(voices):
        eng.voices.add(synthetic_voice(bundle, f"v{v}", 40 + v))
    for i in range(sessions):
        params = replace(SamplingParams.defaults(variant), seed=700 + i, max_new_tokens=200)  # type: ignore[arg-type]
        eng.submit(SegmentRequest(request_id=f"s{i}", text=TEXTS[i], voice_id=f"v{i % voices}", params=params,
                                  sink=lambda output: None))
    with torch.no_grad():
        while len(eng.scheduler.running) < sessions or any(
                not eng.scheduler.tokens_sampled(s) for s in eng.scheduler.running):
            eng._step()
        eng._step()
        with count_ops() as counter:
            eng._step()
    assert len(eng.scheduler.running) == sessions  # nobody ended: the counted step decoded them all
    return counter.ops


@pytest.mark.parametrize("compact", [False, True], ids=["bucket", "compact"])
@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_ops_per_decode_step_do_not_grow_with_voices_or_rows_inside_a_bucket(variant: str, compact: bool) -> None:
    """One attention call per layer over a prefix copied into each row: 8 segments on 8 voices run the same
    ops as on 1 voice, and 5 segments (same row bucket) the same as 8. No op reads a device value back
    (`.item()` is `_local_scalar_dense`); the step's one host sync, `.tolist()`, dispatches no op. The CPU's compact
    step (only the plan's rows, no bucket) differs by one op per segment, the draw from its own generator."""
    one_voice = _ops_per_decode_step(variant, 8, 1, compact)
    eight_voices = _ops_per_decode_step(variant, 8, 8, compact)
    fewer_rows = _ops_per_decode_step(variant, 5, 2, compact)
    assert one_voice == eight_voices
    if compact:
        assert one_voice - fewer_rows == Counter({"aten.exponential_": 3}) and not fewer_rows - one_voice
    else:
        assert one_voice == fewer_rows
    assert one_voice["aten._local_scalar_dense"] == 0


@contextlib.contextmanager
def _engine_like_the_fixture(lend_threads: bool = True, decode_borrows_threads: bool = True) -> Iterator[Engine]:
    """A started english engine with the fixture's chunk settings and default voice, lending as asked."""
    from synth import default_voice

    other = make_engine("english", render_audio=True, max_slots=8, first_chunk_tokens=6,
                        chunk_schedule_tokens=(8, 16), lend_threads=lend_threads,
                        decode_borrows_threads=decode_borrows_threads)
    other.voices.add(default_voice(tiny_bundle("english")))
    other.start()
    try:
        assert other.wait_ready(120)
        yield other
    finally:
        other.stop()


def _speak(engine: Engine, rid: str, text: str, seed: int) -> Collector:
    col = Collector()
    engine.submit(_request(col, rid, text, seed=seed))
    col.wait_done([rid])
    return col


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU thread lending")
def test_a_lone_first_chunk_renders_on_lent_threads_with_the_same_pcm(engine: Engine) -> None:
    """CPU: a turn's first chunk borrows the decode's threads (synth/cpu_threads.CoreLease); a seeded segment's
    audio is the same as from an engine that never lends."""
    lent_before = engine.lease.lent_ticks
    lent = _speak(engine, "lent", TEXTS[2], seed=77)
    assert engine.lease.lent_ticks > lent_before and engine.status()["lend_threads"] is True
    with _engine_like_the_fixture(lend_threads=False) as static:
        col = _speak(static, "static", TEXTS[2], seed=77)
        assert static.lease.lent_ticks == 0 and static.status()["lent_ticks"] == 0
        assert col.tokens("static") == lent.tokens("lent")
        assert np.array_equal(_pcm(col, "static"), _pcm(lent, "lent"))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU thread lending")
def test_decode_steps_that_borrow_the_vocoders_threads_give_the_same_tokens_and_pcm(engine: Engine) -> None:
    """By default decode steps run on the vocoder's threads too while it has nothing to render (CoreLease +
    BorrowGain); a seeded segment's tokens and audio are those of an engine whose decode never borrows."""
    engine.lease.gain = BorrowGain()  # fresh (what earlier tests taught it depends on the load): it tries borrowing
    borrowed_before = engine.lease.borrowed_steps
    both = _speak(engine, "both", TEXTS[1], seed=81)
    status = engine.status()
    assert status["decode_borrows_threads"] is True and engine.lease.borrowed_steps > borrowed_before
    with _engine_like_the_fixture(decode_borrows_threads=False) as own:
        col = _speak(own, "own", TEXTS[1], seed=81)
        assert own.status()["borrowed_steps"] == 0 and own.lease.lent_ticks > 0  # the vocoder still borrows
        assert col.tokens("own") == both.tokens("both")
        assert np.array_equal(_pcm(col, "own"), _pcm(both, "both"))


def test_cpu_vocoder_bf16_renders_the_same_tokens_as_audio_close_to_fp32(engine: Engine) -> None:
    """`cpu_vocoder="bf16"`: the engine's vocoder runs bfloat16 products (status says so); a seeded segment
    gets the same tokens as on the float32 engine and audio within bf16 rounding of its audio."""
    from synth import default_voice, invariant_ops

    if not invariant_ops.bf16_gemms_supported():
        pytest.skip("this CPU has no native bf16 products (the engine refuses cpu_vocoder='bf16'; tested below)")
    exact = Collector()
    engine.submit(_request(exact, "fp32", TEXTS[2], seed=91))
    exact.wait_done(["fp32"])
    lowered = make_engine("english", render_audio=True, max_slots=8, first_chunk_tokens=6,
                          chunk_schedule_tokens=(8, 16), cpu_vocoder="bf16")
    lowered.voices.add(default_voice(tiny_bundle("english")))
    lowered.start()
    try:
        assert lowered.wait_ready(120)
        assert lowered.vocoder.gemm_dtype == torch.bfloat16 and lowered.status()["cpu_vocoder"] == "bf16"
        col = Collector()
        lowered.submit(_request(col, "bf16", TEXTS[2], seed=91))
        col.wait_done(["bf16"])
        assert col.tokens("bf16") == exact.tokens("fp32")
        got, want = _pcm(col, "bf16"), _pcm(exact, "fp32")
        assert got.size == want.size and not np.array_equal(got, want)
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 0.02
    finally:
        lowered.stop()


def test_cpu_vocoder_bf16_is_refused_where_it_does_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from synth import invariant_ops

    with pytest.raises(EngineError, match="'fp32' or 'bf16'"):
        make_engine("turbo", render_audio=False, max_slots=1, cpu_vocoder="fp16")
    monkeypatch.setattr(invariant_ops, "bf16_gemms_supported", lambda: False)
    with pytest.raises(EngineError, match="AVX512-BF16 or AMX"):
        make_engine("turbo", render_audio=False, max_slots=1, cpu_vocoder="bf16")


def test_vocoder_graphs_are_refused_without_cuda() -> None:
    """`vocoder_graphs="on"` captures CUDA graphs: on another device the engine refuses to start, with the reason
    (it never says ready and then fails every session); "auto" is eager there and says why; "off" is the default
    and says so in the status."""
    if torch.device(TEST_DEVICE).type == "cuda":
        pytest.skip("this run's device has CUDA (tests/synth/test_render_graphs.py replays the vocoder there)")
    with pytest.raises(EngineError, match="vocoder_graphs='on' needs a CUDA device"):
        make_engine("turbo", render_audio=True, max_slots=1, vocoder_graphs="on")
    with pytest.raises(EngineError, match="'auto', 'on' or 'off'"):
        make_engine("turbo", render_audio=True, max_slots=1, vocoder_graphs="always")
    status = make_engine("turbo", render_audio=True, max_slots=1).status()
    graphs = (status["vocoder_graphs"], status["vocoder_graphs_captured"], status["vocoder_graphs_failed"],
              status["vocoder_graphs_mismatched"])
    assert graphs == ("off", 0, 0, 0)


def test_start_up_captures_the_vocoders_first_chunk_graphs() -> None:
    """With the vocoder's graphs on (here without the capture: `vocoder_graphs="on"` needs CUDA), the engine
    captures the first-chunk ticks of 1, 2, 4 ... max_batch streams of its warm-up voice before it says ready,
    so no listener's first audio waits on a capture."""
    from synth import default_voice

    engine = make_engine("turbo", render_audio=True, max_slots=2)
    engine.voices.add(default_voice(tiny_bundle("turbo")))
    graphs = engine.vocoder.use_graphs(capture=False)
    worker = engine.vocoder_worker
    assert worker is not None
    warmed: list[int | None] = []
    warm = worker.warm_graphs

    def spy(voice_key: str, timeout_s: float) -> int | None:
        warmed.append(warm(voice_key, timeout_s))
        return warmed[-1]

    worker.warm_graphs = spy  # type: ignore[method-assign]
    engine.start()
    try:
        assert engine.wait_ready(120), engine.failure
        batches = (worker.max_batch - 1).bit_length() + 1  # 1, 2, 4, ... max_batch
        assert warmed == [3 * batches] and graphs.captured >= warmed[0]  # then the warm-up segment's own renders
    finally:
        engine.stop()
