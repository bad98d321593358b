"""What one engine step costs the host: aten ops dispatched and host<->device transfers, counted per step.

On a GPU every aten op is a kernel launch (~5-10 us of host time) and every transfer that waits for the device
is a stall, so these counts are what a decode step costs on an H200 whatever the CPU says about milliseconds.
They are counted on any device (the CPU included) by a `TorchDispatchMode` over one `Engine._step` call:

- `ops`: every aten op the step dispatches (the model, sampling, bookkeeping); `view_ops` of them are views
  (metadata only, no kernel on a GPU), so `kernel_ops = ops - view_ops` is closer to launches. How many views
  a composite op (matmul, reshape, indexing) dispatches depends on shapes and strides: compare `ops` between
  steps of one shape (one bucket), not across shapes.
- `device_to_host`: reads of device values on the host: `aten._local_scalar_dense` (`.item()`, `int(t)`,
  `bool(t)`), `Tensor.tolist()` and `Tensor.numpy()` calls, and copies from a non-CPU device to the CPU.
- `host_to_device`: tensors made from host (Python) data, `aten.lift_fresh` (`torch.tensor(list)`,
  `torch.as_tensor(list)`), and copies from the CPU to another device. On the CPU the first kind is counted as
  the transfer it is on a GPU (`torch.tensor(list, device="cuda")` is a blocking copy from pageable memory).

The issue-14 contract: with work to do, a decode step reads the sampled ids back once (`device_to_host == 1`)
and sends what the next step needs in at most one copy (`host_to_device <= 1`); `ops` does not grow with the
number of distinct voices in the batch, nor with the rows inside one row bucket.

Hook: `Engine._step` (the loop's one iteration, on the engine thread), wrapped by an instance attribute, so the
measurement runs the engine as it runs in production and needs no other entry point. Only public names of
`synth` are used otherwise (Engine, SegmentRequest, SamplingParams, Voice), plus `engine.scheduler.running`
to know how many segments a counted step decoded. This file imports nothing from tests/ so that
scripts/bench_engine.py can load it by path against another checkout's `synth`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from synth.api import EngineError, EngineOutput, EventKind, SamplingParams, SegmentEvent, SegmentRequest
from synth.engine import Engine
from synth.voices import Voice

SPEECH_TOKEN_IDS = 6561  # ids a synthetic voice prompt draws from
STEPS_TO_COUNT = 3
SEGMENT_TOKENS = 400  # long enough that no segment ends while the counted steps run (EOS aside, see below)
WAIT_S = 600.0
POLL_S = 0.05  # how often a wait looks at whether the engine thread is still alive
TEXT = "Counting what one decode step costs."

_LOCAL_SCALAR = "aten._local_scalar_dense"
_LIFT_FRESH = ("aten.lift_fresh", "aten.lift_fresh_copy")
_COPIES = ("aten._to_copy", "aten.copy_", "aten.to")


@dataclass
class StepCounts:
    ops: int = 0
    view_ops: int = 0
    device_to_host: int = 0
    host_to_device: int = 0
    by_op: Counter[str] = field(default_factory=Counter)
    transfers: Counter[str] = field(default_factory=Counter)  # what each transfer was, for the failure message
    ms: float = 0.0  # wall time of the counted step (slowed by the counting itself: use uncounted steps for ms)

    @property
    def kernel_ops(self) -> int:
        return self.ops - self.view_ops

    @property
    def host_syncs(self) -> int:
        return self.device_to_host + self.host_to_device


class _Local(threading.local):
    counter: _StepCounter | None = None
    inside_host_read: bool = False


_LOCAL = _Local()


def _devices(value: Any) -> set[str]:
    if isinstance(value, torch.Tensor):
        return {value.device.type}
    return set()


class _StepCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's untyped __init_subclass__
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts = StepCounts()

    def note(self, kind: str, what: str) -> None:
        if kind == "d2h":
            self.counts.device_to_host += 1
        else:
            self.counts.host_to_device += 1
        self.counts.transfers[f"{kind}:{what}"] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _LOCAL.inside_host_read:  # the copy inside a counted .tolist() / .numpy(): counted there
            return func(*args, **kwargs)
        name = str(func.overloadpacket)
        self.counts.ops += 1
        self.counts.view_ops += int(bool(getattr(func, "is_view", False)))
        self.counts.by_op[name] += 1
        if name == _LOCAL_SCALAR:
            self.note("d2h", "item")
        elif name in _LIFT_FRESH:
            self.note("h2d", "tensor(list)")
        elif name in _COPIES:
            self._note_copy(name, args, kwargs)
        return func(*args, **kwargs)

    def _note_copy(self, name: str, args: Any, kwargs: Any) -> None:
        if name == "aten.copy_" and len(args) >= 2:
            dst, src = _devices(args[0]), _devices(args[1])
        else:
            src = _devices(args[0]) if args else set()
            target = kwargs.get("device")
            dst = {torch.device(target).type} if target is not None else src
        if src and dst and src != dst:
            self.note("d2h" if dst == {"cpu"} else "h2d", f"{name} {sorted(src)}->{sorted(dst)}")


@contextlib.contextmanager
def _host_reads_counted() -> Iterator[None]:
    """`Tensor.tolist` / `Tensor.numpy` counted as device->host reads while a counter is active on this thread
    (on the CPU they dispatch no aten op at all, on a GPU a copy that would be counted twice)."""
    originals: dict[str, Callable[..., Any]] = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy}

    def wrap(name: str) -> Callable[..., Any]:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter = _LOCAL.counter
            if counter is None or _LOCAL.inside_host_read:
                return original(self, *args, **kwargs)
            counter.note("d2h", name)
            _LOCAL.inside_host_read = True
            try:
                return original(self, *args, **kwargs)
            finally:
                _LOCAL.inside_host_read = False

        return read

    for name in originals:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def count_step() -> Iterator[StepCounts]:
    """Count what the enclosed code does on this thread (ops and transfers): one step's worth."""
    counter = _StepCounter()
    _LOCAL.counter = counter
    t0 = time.perf_counter()
    try:
        with _host_reads_counted(), counter:
            yield counter.counts
    finally:
        _LOCAL.counter = None
        counter.counts.ms = (time.perf_counter() - t0) * 1e3


class StepProbe:
    """Wraps `engine._step`: when armed, counts the next steps that start and end with exactly `expected`
    segments running (a step that admitted or ended one is not a steady decode step and is passed over)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._original: Callable[[], None] = engine._step
        self._lock = threading.Lock()
        self._armed = 0
        self._expected = -1
        self._counted = True
        self._results: list[StepCounts] = []
        self._done = threading.Event()
        engine._step = self._step  # type: ignore[method-assign]

    def close(self) -> None:
        del self.engine._step  # the class's method again

    def _running(self) -> int:
        return len(self.engine.scheduler.running)

    def _step(self) -> None:
        with self._lock:
            armed, expected, counted = self._armed, self._expected, self._counted
        if not armed or self._running() != expected:
            self._original()
            return
        if counted:
            with count_step() as counts:
                self._original()
        else:  # timed only: the dispatch mode's own cost stays out of the milliseconds
            counts = StepCounts()
            self._synchronize()
            t0 = time.perf_counter()
            self._original()
            self._synchronize()
            counts.ms = (time.perf_counter() - t0) * 1e3
        if self._running() != expected:
            return
        with self._lock:
            self._results.append(counts)
            self._armed -= 1
            if not self._armed:
                self._done.set()

    def _synchronize(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

    def count(self, expected_running: int, steps: int, counted: bool = True,
              timeout_s: float = WAIT_S) -> list[StepCounts]:
        """The next `steps` steady steps with `expected_running` segments: counted (ops, transfers) or, with
        counted=False, only timed (`ms`, CUDA synchronized around the step)."""
        with self._lock:
            self._results, self._expected, self._armed, self._counted = [], expected_running, steps, counted
            self._done.clear()
        deadline = time.monotonic() + timeout_s
        while not self._done.wait(POLL_S):
            if not self.engine.alive or time.monotonic() > deadline:
                with self._lock:
                    self._armed = 0
                if not self.engine.alive:
                    raise EngineDied(self.engine.failure)
                raise TimeoutError(f"no {steps} steps with {expected_running} segments running in {timeout_s} s "
                                   f"(got {len(self._results)}; running now: {self._running()})")
        with self._lock:
            return list(self._results)


def synthetic_voice(engine: Engine, voice_id: str, seed: int) -> Voice:
    """A voice with random conditioning of the model's shapes (cheap: no clip, no encoders)."""
    g = torch.Generator().manual_seed(seed)
    bundle = engine.bundle
    prompt_tokens = bundle.t3.hp.speech_cond_prompt_len
    return Voice(voice_id=voice_id, speaker_emb=torch.randn(1, 256, generator=g).to(bundle.device),
                 prompt_speech_tokens=torch.randint(0, SPEECH_TOKEN_IDS, (1, prompt_tokens), generator=g).to(
                     bundle.device), s3gen_ref={})


class EngineDied(RuntimeError):
    """The engine thread died while a measurement waited for it (its failure is the message)."""

    def __init__(self, failure: str) -> None:
        super().__init__(f"the engine thread died: {failure or 'no failure recorded'}")


@dataclass
class _Segments:
    started: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def sink(self, request_id: str) -> Callable[[EngineOutput], None]:
        def on_output(output: EngineOutput) -> None:
            if not isinstance(output, SegmentEvent):
                return
            with self.changed:
                if output.kind == EventKind.STARTED:
                    self.started.add(request_id)
                elif output.kind >= EventKind.DONE:
                    self.ended.add(request_id)
                self.changed.notify_all()

        return on_output

    def wait(self, predicate: Callable[[], bool], what: str, engine: Engine, timeout_s: float = WAIT_S) -> None:
        """Until `predicate` holds; raises at `timeout_s`, or as soon as the engine thread has died (a dead engine's
        failure events may never all come: waiting for them would hang the caller)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not self.changed.wait_for(predicate, POLL_S):
                if not engine.alive:
                    raise EngineDied(engine.failure)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out waiting for {what}")


def voices_for(engine: Engine, n_voices: int, prefix: str = "opcount") -> list[str]:
    """`n_voices` distinct synthetic voices registered with `engine` (added once, reused)."""
    ids = [f"{prefix}-{i}" for i in range(n_voices)]
    known = set(engine.voice_ids())
    for i, voice_id in enumerate(ids):
        if voice_id not in known:
            engine.voices.add(synthetic_voice(engine, voice_id, seed=9000 + i))
    return ids


def measure_decode_steps(engine: Engine, n_segments: int, n_voices: int, steps: int = STEPS_TO_COUNT,
                         probe: StepProbe | None = None, seed: int = 0, timed_steps: int = 0) -> list[StepCounts]:
    """Counts of `steps` steady decode steps of a started engine running `n_segments` segments on `n_voices`
    distinct voices (segment i on voice i mod n_voices), then `timed_steps` more steps timed only (returned
    after the counted ones, with zero counts). Every segment is cancelled afterwards.

    A segment that samples EOS before the counted steps (random weights do, rarely) leaves fewer running than
    asked: then the whole measurement is retried with other seeds, up to three times."""
    own_probe = probe is None
    probe = probe or StepProbe(engine)
    try:
        for attempt in range(3):
            try:
                return _measure_once(engine, probe, n_segments, n_voices, steps, timed_steps, seed + 1000 * attempt)
            except _SegmentEnded:
                continue
        raise RuntimeError(f"segments kept ending before {steps} steps with {n_segments} running could be counted")
    finally:
        if own_probe:
            probe.close()


class _SegmentEnded(Exception):
    pass


def _measure_once(engine: Engine, probe: StepProbe, n_segments: int, n_voices: int, steps: int, timed_steps: int,
                  seed: int) -> list[StepCounts]:
    voices = voices_for(engine, n_voices)
    segments = _Segments()
    params = replace(SamplingParams.defaults(engine.variant), max_new_tokens=SEGMENT_TOKENS)
    ids = [f"ops-{seed}-{n_segments}x{n_voices}-{i}" for i in range(n_segments)]
    try:
        for i, request_id in enumerate(ids):
            try:
                engine.submit(SegmentRequest(request_id=request_id, text=TEXT, voice_id=voices[i % n_voices],
                                             params=replace(params, seed=seed + 7 * i), sink=segments.sink(request_id)))
            except EngineError:
                if not engine.alive:  # it died on a step between two submissions (a loaded machine)
                    raise EngineDied(engine.failure) from None
                raise
        segments.wait(lambda: len(segments.started | segments.ended) == n_segments, "every segment's first token",
                      engine)
        if segments.ended:
            raise _SegmentEnded
        try:
            counted = probe.count(n_segments, steps)
            return counted + (probe.count(n_segments, timed_steps, counted=False) if timed_steps else [])
        except TimeoutError:
            if segments.ended:
                raise _SegmentEnded from None
            raise
    finally:
        if engine.alive:  # (a dead engine: the error that says so is already on its way up)
            for request_id in ids:
                engine.cancel(request_id)
            segments.wait(lambda: len(segments.ended) == n_segments, "every segment's terminal event", engine)
            _wait_idle(engine)


def _wait_idle(engine: Engine, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.running:
        if not engine.alive:
            raise EngineDied(engine.failure)
        if time.monotonic() > deadline:
            raise TimeoutError("the engine kept running segments after they were all cancelled")
        time.sleep(0.005)
