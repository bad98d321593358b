from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from synth.api import AudioChunk, EngineConfig, EngineOutput, EventKind, SegmentEvent, Sink, Variant
from synth.engine import Engine
from synth.loading import ModelBundle, random_bundle
from synth.voices import Voice

# CPU by default; scripts/gpu_check.sh runs the same tests with SYNTH_TEST_DEVICE=cuda, and SYNTH_TEST_CUDA_GRAPHS=off
# where a test counts the ops of eager steps (a graph replay dispatches none: tests/synth/test_step_counts.py).
TEST_DEVICE = os.environ.get("SYNTH_TEST_DEVICE", "cpu")
TEST_CUDA_GRAPHS = os.environ.get("SYNTH_TEST_CUDA_GRAPHS", "auto")
_BUNDLES: dict[Variant, ModelBundle] = {}


def tiny_bundle(variant: Variant) -> ModelBundle:
    """One random tiny model per variant per test session (building is cheap, but keep it shared)."""
    if variant not in _BUNDLES:
        _BUNDLES[variant] = random_bundle(variant, "tiny", torch.device(TEST_DEVICE))
    return _BUNDLES[variant]


def synthetic_voice(bundle: ModelBundle, voice_id: str, seed: int) -> Voice:
    """A voice with random conditioning of the right shapes (cheaper than cloning a clip)."""
    g = torch.Generator().manual_seed(seed)
    plen = bundle.t3.hp.speech_cond_prompt_len
    return Voice(voice_id=voice_id, speaker_emb=torch.randn(1, 256, generator=g).to(bundle.device),
                 prompt_speech_tokens=torch.randint(0, 6561, (1, plen), generator=g).to(bundle.device), s3gen_ref={})


@dataclass
class Collector:
    """A thread-safe sink that records everything the engine sends per request."""

    events: dict[str, list[EngineOutput]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: queue.Queue[str] = field(default_factory=queue.Queue)

    def sink_for(self, request_id: str) -> Sink:
        def sink(output: EngineOutput) -> None:
            with self.lock:
                self.events.setdefault(request_id, []).append(output)
            if isinstance(output, SegmentEvent) and output.kind >= EventKind.DONE:
                self.done.put(request_id)

        return sink

    def kinds(self, request_id: str) -> list[EventKind]:
        with self.lock:
            return [e.kind for e in self.events.get(request_id, []) if isinstance(e, SegmentEvent)]

    def tokens(self, request_id: str) -> list[int]:
        with self.lock:
            for e in self.events.get(request_id, []):
                if isinstance(e, SegmentEvent) and e.kind == EventKind.GENERATED:
                    return list(e.token_ids)
        raise AssertionError(f"{request_id} has no GENERATED event: {self.kinds(request_id)}")

    def chunks(self, request_id: str) -> list[AudioChunk]:
        with self.lock:
            return [e for e in self.events.get(request_id, []) if isinstance(e, AudioChunk)]

    def wait_done(self, request_ids: list[str], timeout_s: float = 120.0) -> None:
        pending = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"timed out waiting for {sorted(pending)}"
            try:
                pending.discard(self.done.get(timeout=remaining))
            except queue.Empty:
                pass

    def wait_kind(self, request_id: str, kind: EventKind, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while kind not in self.kinds(request_id):
            assert time.monotonic() < deadline, f"{request_id} never reached {kind.name}: {self.kinds(request_id)}"
            time.sleep(0.002)


class ArrivesAtLayer(threading.Event):
    """`Engine.turn_arrived` whose `arrive` runs while layer `layer` of a jobs-only step asks it (the runner asks
    before each layer), once: a live segment submitted mid-step, at a chosen layer, on the test's own thread (the
    engine is stepped by hand there). Asks from other threads (the vocoder worker's `turn_pending`) are not counted."""

    def __init__(self, layer: int, arrive: Callable[[], None]) -> None:
        super().__init__()
        self.layer, self._arrive, self.asked = layer, arrive, 0
        self._stepping_thread = threading.get_ident()

    def is_set(self) -> bool:
        if threading.get_ident() == self._stepping_thread:
            if self.asked == self.layer:
                self._arrive()  # Engine.submit: the inbox, then set()
            self.asked += 1
        return super().is_set()



def make_engine(variant: Variant, *, render_audio: bool, max_slots: int = 4, bundle: ModelBundle | None = None,
                **overrides: object) -> Engine:
    """An engine on the shared tiny bundle, or on `bundle` (an engine with cpu_weights="bf16" rounds its
    bundle's weights in place, so give it one of its own)."""
    overrides.setdefault("cuda_graphs", TEST_CUDA_GRAPHS)
    config = EngineConfig(variant=variant, weights="random-tiny", device=TEST_DEVICE, max_slots=max_slots,
                          max_context_tokens=overrides.pop("max_context_tokens", 1024),  # type: ignore[arg-type]
                          **overrides)  # type: ignore[arg-type]
    engine = Engine(bundle or tiny_bundle(variant), config, render_audio=render_audio)
    return engine


@pytest.fixture
def collector() -> Collector:
    return Collector()
