"""synth/host_memory.py: with freed memory retained, a render-like thread stops faulting its temporaries in again.

Each case runs in a fresh interpreter (the setting is process-wide and cannot be undone): a thread other than the
main one (like the vocoder worker: its own malloc arena) allocates and frees 40 tensors of 1.6 MB per "tick"
(the size of a batched prompt-cache slice of a full-size Turbo tick) and counts its minor page faults over five
ticks after two warm-up ticks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from synth.api import EngineConfig, EngineError
from synth.host_memory import retained

from tests.synth.conftest import TEST_DEVICE, make_engine

REPO = Path(__file__).resolve().parents[2]

TICKS = """
import resource, sys, threading, torch
from synth.host_memory import retain_freed_memory
if sys.argv[1] == "retain":
    assert retain_freed_memory() and retain_freed_memory()  # idempotent
out = {}
def work():
    def faults():
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    def tick():
        temporaries = [torch.empty(400_000).fill_(1.0) for _ in range(40)]
        del temporaries
    tick(); tick()
    before = faults()
    for _ in range(5):
        tick()
    out["faults"] = faults() - before
thread = threading.Thread(target=work)
thread.start(); thread.join()
print(out["faults"])
"""


def _tick_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", TICKS, mode], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and RUSAGE_THREAD: Linux only")
def test_retained_memory_is_not_faulted_in_again() -> None:
    system, retain = _tick_faults("system"), _tick_faults("retain")
    # measured on the CI image (glibc 2.36): 11,297 faults as malloc ships, 977 retained
    assert system > 5 * retain, (system, retain)


def test_engine_applies_it_on_the_cpu_and_rejects_unknown_modes() -> None:
    engine = make_engine("turbo", render_audio=False, max_slots=1)  # not started: nothing to stop
    if TEST_DEVICE == "cpu":
        assert retained() and engine.status()["host_memory"] == "retain"
    with pytest.raises(EngineError, match="host_memory"):
        make_engine("turbo", render_audio=False, max_slots=1, host_memory="lots")
    assert EngineConfig().host_memory == "retain"
