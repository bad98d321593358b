"""synth.voices: a voice's conditioning as bytes (voice_to_bytes / voice_from_bytes) for other replicas."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from synth.api import EngineError, SamplingParams, SegmentRequest
from synth.loading import random_bundle
from synth.presets import synthetic_reference_wav
from synth.voices import Voice, voice_from_bytes, voice_to_bytes
from tests.synth.conftest import TEST_DEVICE, Collector, make_engine

REPO = Path(__file__).resolve().parents[2]


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
    code = ("import hashlib; from tests.synth.test_voices import sample_voice; from synth.voices import voice_to_bytes; "
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


def test_an_imported_voice_speaks_exactly_as_on_the_engine_that_computed_it(collector: Collector) -> None:
    """Engine.export_voice / import_voice: a second engine serves a voice without its encoders, sample for
    sample the same as the engine that computed it from the clip."""
    # two bundles of the same random weights (seeded), as two replicas have: S3Gen is not shared by threads
    computing, importing = (make_engine("turbo", render_audio=True, max_slots=2,
                                        bundle=random_bundle("turbo", "tiny", torch.device(TEST_DEVICE)))
                            for _ in range(2))
    rate_hz = 24_000
    computing.add_voice("clone", synthetic_reference_wav(rate_hz, seed=5), rate_hz)  # another clip than default's
    importing.import_voice("clone", computing.export_voice("clone"))
    assert importing.voices.get("clone").key == computing.voices.get("clone").key
    try:
        for name, engine in (("a", computing), ("b", importing)):  # one after the other, each alone
            engine.start()
            assert engine.wait_ready(60)
            engine.submit(SegmentRequest(request_id=name, text="Hello there.", sink=collector.sink_for(name),
                                         voice_id="clone", params=SamplingParams(seed=7, max_new_tokens=30)))
            collector.wait_done([name])
        assert collector.tokens("a") == collector.tokens("b")
        pcm = [np.concatenate([c.pcm for c in collector.chunks(r)]) for r in ("a", "b")]
        assert len(pcm[0]) > 0 and np.array_equal(pcm[0], pcm[1])
    finally:
        for engine in (computing, importing):
            engine.stop()
