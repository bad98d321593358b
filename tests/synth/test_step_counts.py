"""Issue 14's counts as tests: what one steady decode step of the engine costs the host (tests/synth/op_counts.py).

- ops per step do not grow with the number of distinct voices in the batch;
- ops per step do not grow with the rows in use inside one row bucket (5 vs 8 segments, 17 vs 32: the same
  bucket for Turbo's one row per segment and English's two); that is the bucket step, what a GPU runs. The CPU's
  compact step (T3Runner.compact_rows: only the plan's rows) has no buckets: its ops grow by exactly one per segment,
  the draw from the segment's own generator, and by nothing else;
- a step reads one value set back from the device (the sampled ids) and sends its inputs in at most one copy.

The engine before the static-buffer step failed all three (its counts: BENCHMARKS.md, issue 14). The counter
itself is checked here on known code, so a counter that saw nothing could not make them pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from synth.api import Variant
from synth.engine import Engine

from tests.synth.conftest import TEST_DEVICE, make_engine
from tests.synth.op_counts import EngineDied, StepCounts, StepProbe, count_step, measure_decode_steps

MAX_SLOTS = 32
VARIANTS: list[Variant] = ["english", "turbo"]


@pytest.fixture(scope="module", params=[(variant, compact) for variant in VARIANTS for compact in (False, True)],
                ids=lambda p: f"{p[0]}-{'compact' if p[1] else 'bucket'}")
def probed(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, StepProbe]]:
    variant, compact = request.param
    engine = make_engine(variant, render_audio=False, max_slots=MAX_SLOTS, compact_steps=compact)
    assert engine.runner.compact_rows == (compact and TEST_DEVICE == "cpu")
    engine.start()
    assert engine.wait_ready(120), engine.failure
    probe = StepProbe(engine)
    yield engine, probe
    probe.close()
    engine.stop()


def _worst(engine: Engine, probe: StepProbe, n_segments: int, n_voices: int) -> StepCounts:
    counts = measure_decode_steps(engine, n_segments, n_voices, probe=probe)
    return max(counts, key=lambda c: (c.ops, c.host_syncs))


# --- the counter, on code whose counts are known (these pass on any engine) ----------------------------------

def test_counter_counts_ops_and_each_kind_of_transfer() -> None:
    x = torch.arange(6.0)
    with count_step() as counts:
        y = (x * 2).sum()  # 2 ops
        value = y.item()  # 1 op, a device->host read
        as_list = x.tolist()  # no aten op on the CPU: counted by the Tensor.tolist hook
        ids = torch.tensor([1, 2, 3])  # host data -> tensor: a host->device transfer on a GPU
    assert value == 30.0 and as_list[-1] == 5.0 and ids.shape == (3,)
    assert counts.device_to_host == 2 and counts.host_to_device == 1
    assert counts.by_op["aten.mul"] == 1 and counts.by_op["aten.sum"] == 1
    assert counts.ops >= 4
    with count_step() as views:
        x.view(2, 3).t()  # two views, no kernel
    assert views.ops == 2 and views.view_ops == 2 and views.kernel_ops == 0


def test_counter_is_off_outside_its_block() -> None:
    with count_step() as counts:
        pass
    torch.arange(3).tolist()
    torch.tensor([1.0]).item()
    assert counts.ops == 0 and counts.host_syncs == 0


def test_probe_counts_real_decode_steps(probed: tuple[Engine, StepProbe]) -> None:
    """Counted steps ran the model: at least one op per layer, the same count every step of one batch."""
    engine, probe = probed
    counts = measure_decode_steps(engine, 2, 1, probe=probe)
    assert len(counts) == 3
    cfg = engine.bundle.t3.cfg
    n_layers = cfg.n_layer if engine.bundle.t3.is_gpt else cfg.num_hidden_layers
    assert min(c.ops for c in counts) > 10 * n_layers
    assert len({c.ops for c in counts}) == 1, [c.ops for c in counts]


# --- the contract -------------------------------------------------------------------------------------------

def test_ops_per_step_do_not_grow_with_distinct_voices(probed: tuple[Engine, StepProbe]) -> None:
    engine, probe = probed
    for n in (8, MAX_SLOTS):
        one_voice, own_voices = _worst(engine, probe, n, 1), _worst(engine, probe, n, n)
        assert own_voices.ops == one_voice.ops, (
            f"{n} segments: {one_voice.ops} ops per step on 1 voice, {own_voices.ops} on {n} voices")


def test_ops_per_step_do_not_grow_with_rows_inside_a_bucket(probed: tuple[Engine, StepProbe]) -> None:
    engine, probe = probed
    per_segment = 1 if engine.runner.compact_rows else 0  # the draw from each segment's generator
    for fewer, more in ((5, 8), (17, MAX_SLOTS)):
        low, high = _worst(engine, probe, fewer, 1), _worst(engine, probe, more, 1)
        assert high.ops - low.ops == per_segment * (more - fewer), (
            f"{low.ops} ops per step at {fewer} segments, {high.ops} at {more}")


def test_one_host_sync_per_step(probed: tuple[Engine, StepProbe]) -> None:
    engine, probe = probed
    for n_segments, n_voices in ((1, 1), (8, 8), (MAX_SLOTS, MAX_SLOTS)):
        counts = _worst(engine, probe, n_segments, n_voices)
        assert counts.device_to_host == 1 and counts.host_to_device <= 1, (
            f"{n_segments} segments on {n_voices} voices: {counts.device_to_host} device->host reads, "
            f"{counts.host_to_device} host->device transfers per step: {dict(counts.transfers)}")


def test_a_measurement_raises_at_once_when_the_engine_thread_dies() -> None:
    """The engine thread dies on a counted step (a runner that raises): the measurement says so with the engine's
    failure within seconds, instead of waiting WAIT_S for steps and terminal events that never come."""
    engine = make_engine("turbo", render_audio=False, max_slots=2)
    engine.start()
    assert engine.wait_ready(120), engine.failure
    execute = engine.runner.execute
    calls = [0]

    def dies_on_the_third_step(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] >= 3:
            raise RuntimeError("injected step failure")
        return execute(*args, **kwargs)  # type: ignore[arg-type]

    engine.runner.execute = dies_on_the_third_step  # type: ignore[method-assign,assignment]
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDied, match="injected step failure"):
            measure_decode_steps(engine, 2, 1)
    finally:
        engine.stop()
    assert time.monotonic() - t0 < 60
