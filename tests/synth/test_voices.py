"""synth/voices.py: a voice's conditioning does not depend on the thread that computes it, and travels as bytes
(voice_to_bytes / voice_from_bytes) to other replicas, which speak it exactly as the one that computed it."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from synth.api import EngineError, EventKind, SamplingParams, SegmentRequest, Variant
from synth.loading import random_bundle
from synth.presets import synthetic_reference_wav
from synth.voices import Voice, make_voice, voice_from_bytes, voice_to_bytes

from tests.synth.conftest import TEST_DEVICE, Collector, make_engine, tiny_bundle

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_conditioning_is_the_same_whatever_the_callers_thread_count(variant: Variant) -> None:
    """Computed with 1 or 2 torch threads on the caller's side, or on a fresh thread: the same content hash
    (torch's FFTs give other bits with other thread counts; make_voice fixes its own). The caller's count is
    left as it was."""
    bundle = tiny_bundle(variant)
    wav = synthetic_reference_wav(24_000, seconds=6.0, seed=77)
    saved = torch.get_num_threads()
    keys = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            keys.append(make_voice(bundle, "v", wav, 24_000).key)
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(saved)
    fresh: list[str] = []
    worker = threading.Thread(target=lambda: fresh.append(make_voice(bundle, "v", wav, 24_000).key))
    worker.start()
    worker.join()
    assert keys[0] == keys[1] == fresh[0]


def sample_voice() -> Voice:
    generator = torch.Generator().manual_seed(3)
    return Voice(
        voice_id="v",
        speaker_emb=torch.randn(1, 256, generator=generator),
        prompt_speech_tokens=torch.randint(0, 6561, (1, 150), generator=generator),
        s3gen_ref={
            "prompt_token": torch.randint(0, 6561, (1, 200), generator=generator),
            "prompt_token_len": torch.tensor([200]),
            "prompt_feat": torch.randn(1, 400, 80, generator=generator),
            "prompt_feat_len": None,
            "embedding": torch.randn(1, 192, generator=generator),
        },
    )


def test_round_trip_keeps_the_conditioning_exactly() -> None:
    voice = sample_voice()
    back = voice_from_bytes("other-id", voice_to_bytes(voice), torch.device("cpu"))
    assert back.voice_id == "other-id" and back.key == voice.key  # Voice.key: a hash of every tensor and value
    assert back.s3gen_ref["prompt_feat_len"] is None and not back.builtin
    no_prompt = Voice("p", voice.speaker_emb, None, {"embedding": voice.s3gen_ref["embedding"]})
    assert voice_from_bytes("p", voice_to_bytes(no_prompt), torch.device("cpu")).key == no_prompt.key


def test_equal_voices_give_equal_bytes_in_any_process() -> None:
    """The bytes' hash is a voice's version on every replica: it must not depend on the process."""
    here = hashlib.sha256(voice_to_bytes(sample_voice())).hexdigest()
    code = ("import hashlib; from tests.synth.test_voices import sample_voice; "
            "from synth.voices import voice_to_bytes; "
            "print(hashlib.sha256(voice_to_bytes(sample_voice())).hexdigest())")
    for _ in range(2):  # (safetensors orders a metadata map differently per process)
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        assert out.stdout.strip() == here


def test_bytes_it_cannot_use_are_refused() -> None:
    blob = voice_to_bytes(sample_voice())
    for junk in (b"", b"\x00" * 16, blob[:-10], blob.replace(b"synth-voice", b"other-form")):
        with pytest.raises(EngineError):
            voice_from_bytes("v", junk, torch.device("cpu"))


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_an_imported_voice_speaks_exactly_as_on_the_engine_that_computed_it(variant: Variant,
                                                                             collector: Collector) -> None:
    """Engine.export_voice / import_voice: a second engine serves a voice without its encoders, sample for
    sample the same as the engine that computed it from the clip, with both running at once (two replicas)."""
    # two bundles of the same random weights (seeded), as two replicas have: S3Gen is not shared by threads
    computing, importing = (make_engine(variant, render_audio=True, max_slots=2,
                                        bundle=random_bundle(variant, "tiny", torch.device(TEST_DEVICE)))
                            for _ in range(2))
    rate_hz = 24_000
    computing.add_voice("clone", synthetic_reference_wav(rate_hz, seed=5), rate_hz)  # another clip than default's
    importing.import_voice("clone", computing.export_voice("clone"))
    assert importing.voices.get("clone").key == computing.voices.get("clone").key
    try:
        for engine in (computing, importing):
            engine.start()
        for engine in (computing, importing):
            assert engine.wait_ready(60)
        for name, engine in (("a", computing), ("b", importing)):
            engine.submit(SegmentRequest(request_id=name, text="Hello there.", sink=collector.sink_for(name),
                                         voice_id="clone", params=SamplingParams(seed=7, max_new_tokens=30)))
        collector.wait_done(["a", "b"])
        assert collector.kinds("a")[-1] == collector.kinds("b")[-1] == EventKind.DONE
        assert collector.tokens("a") == collector.tokens("b")
        pcm = [np.concatenate([c.pcm for c in collector.chunks(r)]) for r in ("a", "b")]
        assert len(pcm[0]) > 0 and np.array_equal(pcm[0], pcm[1])
    finally:
        for engine in (computing, importing):
            engine.stop()
