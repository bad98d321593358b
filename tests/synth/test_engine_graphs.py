"""The engine's start-up on a GPU, where the CPU can show it: graphs captured after the warm-up threads are idle,
a capture failure or a replay that differs from eager falls back to eager with the reason (or refuses to start
with "on"), every engine thread bound to the engine's device, and the slot count sized to the memory budget.

A CUDA graph cannot be captured on a CPU, so the capture is simulated: `StepGraph._capture` (the one place that
talks to CUDA) is replaced by one that raises, or by a "graph" whose replay calls the captured function (and,
to simulate a replay that differs, then moves the logits). Everything around it is the engine's real start-up.
The real captures and replays: tests/synth/test_graph_parity.py and test_cuda_graphs.py, on a CUDA device."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from synth import default_voice, gpu
from synth.api import EngineError, SamplingParams, SegmentRequest, Variant
from synth.engine import Engine
from synth.loading import resolve_device
from synth.step_buffers import StepGraph, key_ladder
from synth.t3_runner import T3Runner
from synth.vocoder import StreamingVocoder

from tests.synth.conftest import TEST_DEVICE, Collector, make_engine, synthetic_voice, tiny_bundle

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="simulates CUDA graphs on the CPU (a CUDA run "
                                "captures real ones: test_graph_parity.py, test_cuda_graphs.py)")

CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"


class _ReplayCalls:
    """A stand-in for a captured CUDA graph: replay calls the function, then `after` (a wrong replay)."""

    def __init__(self, fn: Callable[[], None], after: Callable[[], None] | None) -> None:
        self.fn, self.after = fn, after

    def replay(self) -> None:
        self.fn()
        if self.after is not None:
            self.after()

    def pool(self) -> None:
        return None


def _simulate_graphs(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                     capture: Callable[[Callable[[], None], bool], Any]) -> None:
    """The engine's runner captures graphs as on a CUDA device, through `capture(fn, draws)` (`draws`: the
    function draws from generators, i.e. it is a sampling graph)."""
    engine.runner.use_graphs = True
    monkeypatch.setattr(StepGraph, "_capture", classmethod(
        lambda cls, fn, device, pool, generators, stream=None: capture(fn, bool(generators))))


def _t3_engine(variant: Variant = "turbo", cuda_graphs: str = "auto") -> Engine:
    engine = make_engine(variant, render_audio=False, max_slots=2, cuda_graphs=cuda_graphs)
    engine.voices.add(synthetic_voice(tiny_bundle(variant), "default", seed=5))
    return engine


def _tokens(engine: Engine, seed: int = 77) -> list[int]:
    collector = Collector()
    params = replace(SamplingParams.defaults(engine.variant), seed=seed, max_new_tokens=20)
    engine.submit(SegmentRequest(request_id="s", text="Graphs or not, the same tokens.", params=params,
                                 sink=collector.sink_for("s")))
    collector.wait_done(["s"])
    return collector.tokens("s")


@pytest.fixture(scope="module")
def eager_tokens() -> list[int]:
    engine = _t3_engine(cuda_graphs="off")
    engine.start()
    try:
        assert engine.wait_ready(120), engine.failure
        return _tokens(engine)
    finally:
        engine.stop()


@pytest.fixture
def started() -> Iterator[list[Engine]]:
    """Engines a test starts; stopped afterwards."""
    engines: list[Engine] = []
    yield engines
    for engine in engines:
        engine.stop()


def _start(engine: Engine, started: list[Engine]) -> bool:
    started.append(engine)
    engine.start()
    return engine.wait_ready(120)


# --- the decode's graphs ----------------------------------------------------------------------------------------

def test_a_capture_that_fails_under_auto_means_eager_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine], eager_tokens: list[int]) -> None:
    engine = _t3_engine(cuda_graphs="auto")

    def fail(fn: Callable[[], None], draws: bool) -> None:
        raise RuntimeError(CAPTURE_ERROR)

    _simulate_graphs(engine, monkeypatch, fail)
    assert engine.config.overlap_steps == "auto"
    engine.overlap_steps = True  # what "auto" is with graphs on a CUDA device
    assert _start(engine, started), engine.failure
    status = engine.status()
    assert status["cuda_graphs_state"] == "fallback" and CAPTURE_ERROR in str(status["cuda_graphs_reason"])
    assert status["cuda_graphs_count"] == 0 and not engine.runner.use_graphs
    assert not engine.overlap_steps  # eager steps as with graphs off: one change, not two, against "off"
    assert _tokens(engine) == eager_tokens


def test_a_capture_that_fails_under_on_refuses_to_start_naming_it(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine]) -> None:
    engine = _t3_engine(cuda_graphs="auto")
    engine.graphs.mode = "on"  # "on" is refused on a CPU at construction: as if built on a CUDA device

    def fail(fn: Callable[[], None], draws: bool) -> None:
        raise RuntimeError(CAPTURE_ERROR)

    _simulate_graphs(engine, monkeypatch, fail)
    assert not _start(engine, started)
    assert "cuda_graphs='on'" in engine.failure and CAPTURE_ERROR in engine.failure
    assert not engine.ready


def test_a_replay_that_differs_from_eager_means_eager_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine], eager_tokens: list[int]) -> None:
    engine = _t3_engine(cuda_graphs="auto")
    runner = engine.runner
    assert isinstance(runner, T3Runner)

    def off_by_a_little() -> None:  # a replay whose logits moved (a kernel that reads a stale buffer, say)
        runner.logits.add_(0.05)

    _simulate_graphs(engine, monkeypatch, lambda fn, draws: _ReplayCalls(fn, None if draws else off_by_a_little))
    assert _start(engine, started), engine.failure
    status = engine.status()
    assert status["cuda_graphs_state"] == "fallback"
    assert "differ from eager" in str(status["cuda_graphs_reason"]) and "decode graph" in str(
        status["cuda_graphs_reason"])
    assert not runner.use_graphs and runner.graphs_captured == 0  # its steps run the eager functions
    assert _tokens(engine) == eager_tokens


def test_a_sampling_replay_that_draws_other_ids_means_eager(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine]) -> None:
    engine = _t3_engine(cuda_graphs="auto")
    runner = engine.runner
    assert isinstance(runner, T3Runner)

    def other_ids() -> None:  # a sampling replay that drew other noise
        runner.sampled.add_(1)

    _simulate_graphs(engine, monkeypatch, lambda fn, draws: _ReplayCalls(fn, other_ids if draws else None))
    assert _start(engine, started), engine.failure
    assert engine.status()["cuda_graphs_state"] == "fallback"
    assert "sampling graph" in str(engine.status()["cuda_graphs_reason"])


def test_replays_equal_to_eager_serve_and_say_so(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine], eager_tokens: list[int]) -> None:
    engine = _t3_engine(cuda_graphs="auto")
    _simulate_graphs(engine, monkeypatch, lambda fn, draws: _ReplayCalls(fn, None))
    assert _start(engine, started), engine.failure
    status = engine.status()
    runner = engine.runner
    assert status["cuda_graphs_state"] == "on" and status["cuda_graphs_reason"] == ""
    assert status["cuda_graphs_parity"] == "bitwise"
    assert status["cuda_graphs_count"] == len(runner.row_buckets) * (len(runner.key_buckets) + 1)
    assert _tokens(engine) == eager_tokens


def test_graphs_are_captured_once_the_vocoders_voice_preparation_is_done(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine]) -> None:
    """The warm-up's other thread (the voice preparation) is idle before the first capture: a capture in torch's
    global mode fails on another thread's cudaMalloc, and one in any mode competes with it for the device."""
    engine = make_engine("turbo", render_audio=True, max_slots=2)
    engine.voices.add(default_voice(tiny_bundle("turbo")))
    worker = engine.vocoder_worker
    assert worker is not None
    order: list[str] = []
    wait_prepared, capture_graphs = worker.wait_prepared, engine.runner.capture_graphs

    def prepared(keys: list[str], timeout_s: float) -> bool:
        done = wait_prepared(keys, timeout_s)
        order.append("voices prepared")
        return done

    def capture() -> Any:
        order.append("capture")
        return capture_graphs()

    monkeypatch.setattr(worker, "wait_prepared", prepared)
    monkeypatch.setattr(engine.runner, "capture_graphs", capture)
    _simulate_graphs(engine, monkeypatch, lambda fn, draws: _ReplayCalls(fn, None))
    assert _start(engine, started), engine.failure
    assert order == ["voices prepared", "capture"]


# --- the vocoder's graphs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "on"])
def test_vocoder_graphs_that_differ_from_eager_fall_back_or_refuse(
        monkeypatch: pytest.MonkeyPatch, started: list[Engine], mode: str) -> None:
    engine = make_engine("turbo", render_audio=True, max_slots=2)
    engine.voices.add(default_voice(tiny_bundle("turbo")))
    assert engine.vocoder is not None
    engine.vocoder.use_graphs(capture=False)  # the graphs' plumbing without a capture (a CPU)
    engine.vocoder_graphs.mode = mode  # as configured on a CUDA device
    problem = "a first chunk's PCM differs from eager by up to 0.2 (tolerance 0.001)"
    monkeypatch.setattr(StreamingVocoder, "check_graphs", lambda self, voice, chunk_tokens: problem)
    ready = _start(engine, started)
    if mode == "on":
        assert not ready and "vocoder_graphs='on'" in engine.failure and problem in engine.failure
        return
    assert ready, engine.failure
    status = engine.status()
    assert status["vocoder_graphs_state"] == "fallback" and status["vocoder_graphs_reason"] == problem
    assert engine.vocoder.graphs is None


def test_vocoder_graphs_auto_is_off_without_cuda_and_says_why() -> None:
    engine = make_engine("turbo", render_audio=True, max_slots=1, vocoder_graphs="auto")
    assert engine.vocoder is not None and engine.vocoder.graphs is None
    with pytest.raises(EngineError, match="vocoder_graphs='on' needs a CUDA device"):
        make_engine("turbo", render_audio=True, max_slots=1, vocoder_graphs="on")
    with pytest.raises(EngineError, match="'auto', 'on' or 'off'"):
        make_engine("turbo", render_audio=True, max_slots=1, vocoder_graphs="yes")


# --- threads and devices ----------------------------------------------------------------------------------------

def test_every_engine_thread_binds_the_engine_device(monkeypatch: pytest.MonkeyPatch, started: list[Engine]) -> None:
    """`--device cuda:N`: a new thread's current CUDA device is 0, so every thread that runs the engine's torch
    work (the step loop, the vocoder worker, the voice preparation) sets the engine's first."""
    bound: list[tuple[str, torch.device]] = []
    real = gpu.bind_thread

    def record(device: torch.device) -> None:
        bound.append((threading.current_thread().name, device))
        real(device)

    monkeypatch.setattr(gpu, "bind_thread", record)
    engine = make_engine("turbo", render_audio=True, max_slots=1)
    engine.voices.add(default_voice(tiny_bundle("turbo")))
    assert _start(engine, started), engine.failure
    assert {name for name, _ in bound} >= {"synth-engine", "synth-vocoder", "synth-voice-prep"}
    assert {device for _, device in bound} == {engine.device}


def test_a_bare_cuda_device_gets_its_index_and_binds_without_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--device cuda` (no index): torch.cuda.set_device refuses a device without one (a ValueError, raised in
    torch's Python before any CUDA call, so this CPU build shows it). The device is resolved to this thread's
    current one at start, and a bare one is never passed to set_device."""
    set_to: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_to.append(device))
    gpu.bind_thread(torch.device("cuda", 1))
    assert set_to == [torch.device("cuda", 1)]
    monkeypatch.undo()
    gpu.bind_thread(torch.device("cuda"))  # (the real set_device would raise)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_an_engine_thread_that_cannot_bind_its_device_says_so_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                        started: list[Engine]) -> None:
    """A failure in a thread's first call (binding the device) kills the engine with its reason, so that a start
    fails at once, naming it, instead of waiting out its whole timeout with no failure recorded."""
    def refuse(device: torch.device) -> None:
        raise ValueError(f"cannot bind {device}")

    monkeypatch.setattr(gpu, "bind_thread", refuse)
    engine = make_engine("turbo", render_audio=False, max_slots=1)
    started.append(engine)
    engine.start()
    assert not engine.wait_ready(30)
    assert not engine.alive and "cannot bind" in engine.failure


def _tf32_switches() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_the_vocoders_tf32_switch_sets_both_of_torchs_on_cuda_and_leaves_a_cpu_alone() -> None:
    """On CUDA "off" (and "auto" beside an fp32 T3) turns both switches off: torch's default for convolutions is
    TF32 on, so leaving them alone would still run the vocoder's convolutions in TF32. On a CPU nothing changes."""
    before = _tf32_switches()
    cuda = torch.device("cuda", 0)
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        assert not gpu.use_vocoder_tf32("off", cuda, torch.bfloat16) and _tf32_switches() == (False, False)
        assert gpu.use_vocoder_tf32("auto", cuda, torch.bfloat16) and _tf32_switches() == (True, True)
        assert not gpu.use_vocoder_tf32("auto", cuda, torch.float32) and _tf32_switches() == (False, False)
        assert gpu.use_vocoder_tf32("on", cuda, torch.float32) and _tf32_switches() == (True, True)
        assert not gpu.use_vocoder_tf32("off", torch.device("cpu"), torch.float32)
        assert _tf32_switches() == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


# --- slots and memory -------------------------------------------------------------------------------------------

def _kv_per_slot(variant: Variant, context_tokens: int = 1024) -> tuple[int, int]:
    """(KV bytes of one slot, max_len) of make_engine's engines, computed here from the model's shapes."""
    t3 = tiny_bundle(variant).t3
    cfg = t3.cfg
    layers, width = (cfg.n_layer, cfg.n_embd) if t3.is_gpt else (cfg.num_hidden_layers, cfg.hidden_size)
    prefix = 1 + (32 if t3.hp.use_perceiver_resampler else t3.hp.speech_cond_prompt_len) + int(t3.hp.emotion_adv)
    max_len = -(-(prefix + context_tokens) // 64) * 64
    rows = 1 if t3.is_gpt else 2
    return rows * 2 * layers * width * max_len * 4, max_len


@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_auto_slots_fill_the_memory_budget_and_say_so(variant: Variant) -> None:
    per_slot, _ = _kv_per_slot(variant)
    budget_gb = 2.3  # below MAX_AUTO_SLOTS slots for either variant: the arithmetic decides, not the cap
    engine = make_engine(variant, render_audio=False, max_slots=0, memory_budget_gb=budget_gb)
    plan = engine.slot_plan
    assert plan is not None and plan.auto and plan.per_slot_bytes == per_slot
    reserved = sum(plan.reserved.values())
    assert plan.reserved["headroom"] == gpu.HEADROOM_MIN_BYTES  # 8 % of 2.3 GB is less than the minimum
    expected = int((budget_gb * 1e9 - reserved) // per_slot)
    assert 1 <= engine.max_slots == expected < gpu.MAX_AUTO_SLOTS
    assert engine.scheduler.config.max_rows == expected * (2 if variant == "english" else 1)
    status = engine.status()
    assert status["max_slots"] == expected and status["max_slots_auto"] is True
    assert f"max_slots {expected} (auto)" in plan.describe()


def test_an_explicit_slot_count_that_does_not_fit_is_refused_with_the_numbers() -> None:
    per_slot, _ = _kv_per_slot("english")
    budget_gb = 2.3
    fits = make_engine("english", render_audio=False, max_slots=0, memory_budget_gb=budget_gb).max_slots
    assert fits < gpu.MAX_AUTO_SLOTS
    ok = make_engine("english", render_audio=False, max_slots=fits, memory_budget_gb=budget_gb)
    assert ok.max_slots == fits
    with pytest.raises(EngineError, match=rf"max_slots {fits + 1} does not fit: .* {fits} slots fit") as refused:
        make_engine("english", render_audio=False, max_slots=fits + 1, memory_budget_gb=budget_gb)
    message = str(refused.value)
    assert "2.30 GB free" in message and "headroom" in message and f"{per_slot / 1e9:.3f} GB a slot" in message
    with pytest.raises(EngineError, match="not one slot fits"):
        make_engine("english", render_audio=False, max_slots=0, memory_budget_gb=1.0)


def test_without_a_budget_a_cpu_engine_keeps_the_slots_it_is_given_and_auto_means_sixteen() -> None:
    assert make_engine("turbo", render_audio=False, max_slots=300).max_slots == 300  # RAM: no check on a CPU
    assert make_engine("turbo", render_audio=False, max_slots=0).max_slots == 16


def test_plan_slots_arithmetic() -> None:
    gib = 2**30
    plan = gpu.plan_slots(0, budget_bytes=80 * gib, total_bytes=80 * gib, per_slot_bytes=gib // 4,
                          reserved={"vocoder graphs": 12 * gib})
    headroom = int(0.08 * 80 * gib)
    assert plan.reserved == {"vocoder graphs": 12 * gib, "headroom": headroom}
    assert plan.slots == min(gpu.MAX_AUTO_SLOTS, (80 * gib - 12 * gib - headroom) // (gib // 4))
    capped = gpu.plan_slots(0, budget_bytes=80 * gib, total_bytes=80 * gib, per_slot_bytes=gib // 64, reserved={})
    assert capped.slots == gpu.MAX_AUTO_SLOTS
    with pytest.raises(gpu.SlotsDoNotFit):
        gpu.plan_slots(plan.slots + 1, budget_bytes=80 * gib, total_bytes=80 * gib, per_slot_bytes=gib // 4,
                       reserved={"vocoder graphs": 12 * gib})


# --- buckets ----------------------------------------------------------------------------------------------------

def test_key_buckets_step_by_64_to_512_then_grow_by_a_quarter() -> None:
    assert key_ladder(1472) == (64, 128, 192, 256, 320, 384, 448, 512, 640, 832, 1088, 1408, 1472)
    assert key_ladder(100) == (64, 100) and key_ladder(64) == (64,) and key_ladder(40) == (40,)
    ladder = key_ladder(4096)
    assert all(b % 64 == 0 for b in ladder) and ladder[-1] == 4096
    above = [b for b in ladder if b > 512]
    assert all(later <= 1.25 * earlier + 64 for earlier, later in itertools.pairwise(above))
    # a Turbo row of ~520 keys reads 640, not the 1,024 of a power-of-two ladder
    assert next(b for b in ladder if b >= 520) == 640
