"""synth/voices.py: a voice's conditioning does not depend on the thread that computes it."""

from __future__ import annotations

import threading

import pytest
import torch

from synth.presets import synthetic_reference_wav
from synth.voices import make_voice

from tests.synth.conftest import tiny_bundle


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_conditioning_is_the_same_whatever_the_callers_thread_count(variant: str) -> None:
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
