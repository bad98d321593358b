"""The vocoder's batched tensor functions replayed as CUDA graphs, one per input signature, captured on first use.

A render tick calls three tensor functions (the encoder over the windows, the estimator step after the cached
prompts, HiFT): about 4,000 kernel launches for full-size Turbo, so on a GPU an eager tick is launch-bound (the
H200 section of BENCHMARKS.md: 78 ms per tick for one stream, 186 ms for 64, for well under that of
arithmetic). Batches are padded to powers of two and windows to length buckets (synth/vocoder.py), so each
function meets a bounded set of input signatures (shapes and dtypes of its tensors, values of the rest); each
signature gets one graph, captured the first time it is met (`StepGraph`'s recipe, the decode's: two warm-up
calls on a side stream and a capture, about three eager calls, once), and replayed from then on. No compiler
runs: a capture costs milliseconds where torch.compile's inductor takes about a minute per shape.

A graph reads and writes fixed addresses, so a call copies its tensor arguments into the signature's static
inputs, replays, and returns copies of the static outputs (the next replay of that graph overwrites them).
Static inputs are shared by the signatures of one function that have the same shape at the same argument (a
batch's cached prompt tensors depend on the batch size, not on the window's bucket), so their memory grows with
the batch sizes met, not with the buckets (full-size Turbo's prompt cache is ~98 MB a stream in float32: static
copies for every power of two up to 64 streams hold 127 streams' worth, ~12 GB of an H200's 141). All graphs of
one `GraphSet` share one memory pool: they replay one after another on the vocoder's stream and each one's
outputs are copied out before the next runs, so one graph's scratch may be another's output memory.

The shapes of a first chunk (one window length, one HiFT length, whatever the voice) are captured for every batch
size at start-up (`StreamingVocoder.warm_first_chunks`, from the engine's warm-up), so a listener's first audio
never waits on a capture; later chunks' lengths follow the listeners and are captured as met.

Capture runs in thread-local capture mode: the decode thread keeps launching (and reading back its sampled ids)
on its own stream while the vocoder thread captures. A signature whose capture fails runs eagerly from then on
(logged once); so does every signature past `max_graphs`.

Every signature's first replay is checked against an eager call on the same static inputs before its outputs are
used, wherever it is captured: at start-up (where the engine also compares a whole first chunk's PCM,
StreamingVocoder.check_graphs) and for the shapes met later, which no start-up check sees. The same kernels on the
same shapes should give the same bits; a replay within REPLAY_TOLERANCE of the largest eager value (about the
dtype's rounding, TF32's for float32) passes; one further off, or of another shape, means that signature runs
eagerly from then on (`GraphSet.mismatched`, logged with how far apart they were). It costs one eager call per
signature, next to the capture's three.

Off CUDA (`capture=False`: the tests, and any device without graphs) the same object runs the same plumbing, the
copies into the same static inputs and out of the same static outputs, with an eager call in place of the replay:
the code CI runs is the code a GPU replays, less the capture itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from synth.step_buffers import StepGraph

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPHS = 192  # per function; past it, new signatures run eagerly
# a first replay passes when every output is within this fraction of the largest |eager| value of that output (about
# one unit of the last place: TF32's 10-bit significand for float32 on CUDA, bf16's 7 bits, fp16's 10)
REPLAY_TOLERANCE = {torch.float32: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

_LeafKey = tuple[Any, ...]


def _leaf_key(leaf: Any) -> _LeafKey:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return ("value", leaf)
    raise TypeError(f"a graphed function takes tensors and plain values, not {type(leaf).__name__}")


@dataclass(slots=True, eq=False)
class _Entry:
    """One signature: its static inputs (tensors) and constants, its graph, its static outputs."""

    inputs: list[Any]
    graph: StepGraph | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_spec: TreeSpec | None = None
    eager: bool = False  # past max_graphs, or its capture failed: called directly, no static buffers


class GraphSet:
    """The graphs of one vocoder: a shared memory pool and the counts its status reports."""

    def __init__(self, capture: bool, max_graphs: int = DEFAULT_MAX_GRAPHS) -> None:
        if capture and not torch.cuda.is_available():
            raise RuntimeError("capturing CUDA graphs needs a CUDA device")
        self.capture = capture
        self.max_graphs = max_graphs
        self.pool: Any = None
        self.stream: Any = None  # the side stream every capture of the set warms up and captures on
        self.captured = 0  # graphs built (captured, or with capture=False: static-buffer entries)
        self.failed = 0  # captures that raised (those signatures run eagerly)
        self.checked = 0  # captured signatures whose first replay matched an eager call
        self.mismatched = 0  # captured signatures whose first replay did not (those run eagerly)

    def wrap(self, fn: Callable[..., Any], name: str) -> ShapeGraphs:
        return ShapeGraphs(fn, self, name)


class ShapeGraphs:
    """`fn` (tensors and tuples of tensors in and out, no host reads) replayed per input signature."""

    def __init__(self, fn: Callable[..., Any], graphs: GraphSet, name: str) -> None:
        self.fn = fn
        self.graphs = graphs
        self.name = name
        self._entries: dict[tuple[TreeSpec, tuple[_LeafKey, ...]], _Entry] = {}
        # static input tensors by (argument leaf, shape, dtype, device): shared across this function's signatures
        self._static: dict[tuple[int, _LeafKey], torch.Tensor] = {}

    def __len__(self) -> int:
        return sum(1 for entry in self._entries.values() if not entry.eager)

    def __call__(self, *args: Any) -> Any:
        leaves, spec = tree_flatten(args)
        signature = (spec, tuple(_leaf_key(leaf) for leaf in leaves))
        entry = self._entries.get(signature)
        if entry is None:
            entry = self._entries[signature] = self._new_entry(leaves, spec)
        if entry.eager:
            return self.fn(*args)
        for static, leaf in zip(entry.inputs, leaves, strict=True):
            if isinstance(leaf, torch.Tensor):
                static.copy_(leaf)
        if entry.graph is not None:
            entry.graph()  # the replay
        else:  # no capture: eager over the static inputs, into the static outputs
            self._run_into(entry, spec)
        assert entry.out_spec is not None
        return tree_unflatten([output.clone() for output in entry.outputs], entry.out_spec)

    def _new_entry(self, leaves: list[Any], spec: TreeSpec) -> _Entry:
        graphs = self.graphs
        if len(self) >= graphs.max_graphs:
            if len(self) == graphs.max_graphs:
                log.warning("vocoder %s: %d graphs built; further shapes run eagerly", self.name, graphs.max_graphs)
            return _Entry(inputs=[], eager=True)
        inputs = [self._static_input(index, leaf) for index, leaf in enumerate(leaves)]
        entry = _Entry(inputs=inputs)
        if graphs.capture:
            for static, leaf in zip(inputs, leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    static.copy_(leaf)
            shapes = [tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)][:4]
            try:
                self._capture(entry, spec)
            except Exception as exc:  # a shape the graph cannot take runs eagerly, the server goes on
                graphs.failed += 1
                log.warning("vocoder %s: capture failed for %s (%s: %s); that shape runs eagerly",
                            self.name, shapes, type(exc).__name__, exc)
                return _Entry(inputs=[], eager=True)
            problem = self._first_replay_differs(entry, spec)
            if problem:
                graphs.mismatched += 1
                log.warning("vocoder %s: the graph for %s replays unlike eager (%s); that shape runs eagerly",
                            self.name, shapes, problem)
                return _Entry(inputs=[], eager=True)
            graphs.checked += 1
        graphs.captured += 1
        return entry

    def _first_replay_differs(self, entry: _Entry, spec: TreeSpec) -> str:
        """'' when a replay over the static inputs (just filled by the call that captured it) gives what an eager call
        on them gives, within REPLAY_TOLERANCE; else what differs."""
        expected, expected_spec = tree_flatten(self.fn(*tree_unflatten(entry.inputs, spec)))
        assert entry.graph is not None
        entry.graph()
        if expected_spec != entry.out_spec or len(expected) != len(entry.outputs):
            return "another output structure"
        for index, (got, want) in enumerate(zip(entry.outputs, expected, strict=True)):
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"output {index}: {tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
            if torch.equal(got, want):
                continue
            if not want.is_floating_point():
                return f"output {index}: integer values differ"
            worst = float((got.float() - want.float()).abs().max())
            scale = float(want.float().abs().max())
            bound = REPLAY_TOLERANCE.get(want.dtype, 2.0**-10) * scale
            if not worst <= bound:  # (NaN fails too)
                return f"output {index}: up to {worst:.3g} apart, bound {bound:.3g}"
        return ""

    def _static_input(self, index: int, leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        key = (index, _leaf_key(leaf))
        static = self._static.get(key)
        if static is None:
            static = self._static[key] = torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device)
        return static

    def _run_into(self, entry: _Entry, spec: TreeSpec) -> None:
        outputs, out_spec = tree_flatten(self.fn(*tree_unflatten(entry.inputs, spec)))
        if not entry.outputs:
            entry.outputs = [torch.empty_like(output) for output in outputs]
            entry.out_spec = out_spec
        for static, output in zip(entry.outputs, outputs, strict=True):
            static.copy_(output)

    def _capture(self, entry: _Entry, spec: TreeSpec) -> None:
        """The decode's capture recipe (`StepGraph`: warm-up calls on a side stream, one capture into the set's
        pool) in thread-local mode: the decode thread keeps launching meanwhile. The captured call's outputs are
        the graph's static outputs."""
        args = tree_unflatten(entry.inputs, spec)
        captured: list[Any] = []

        def call() -> None:
            captured[:] = [self.fn(*args)]  # the last call, the captured one, leaves its outputs

        device = next((leaf.device for leaf in entry.inputs if isinstance(leaf, torch.Tensor)), None)
        if self.graphs.stream is None and device is not None and device.type == "cuda":
            self.graphs.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        graph = StepGraph(call, capture=True, device=device, pool=self.graphs.pool, stream=self.graphs.stream)
        if self.graphs.pool is None:
            self.graphs.pool = graph.pool()
        entry.outputs, entry.out_spec = tree_flatten(captured[0])
        entry.graph = graph
