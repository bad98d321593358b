"""synth/render_graphs.py's contract, without a GPU: `capture=False` runs the plumbing a CUDA graph replay uses
(static inputs per signature, static outputs copied out), so what it promises can be checked on the CPU.
The vocoder through it: tests/synth/test_vocoder.py::test_graphed_renders_equal_eager_renders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from synth.render_graphs import REPLAY_TOLERANCE, GraphSet, ShapeGraphs
from synth.step_buffers import StepGraph


def _affine(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], scale: float) -> tuple[torch.Tensor, ...]:
    weight, bias = pair
    return x @ weight * scale + bias, x.sum(dim=-1)


def _graphed(max_graphs: int = 8) -> tuple[GraphSet, ShapeGraphs]:
    graphs = GraphSet(capture=False, max_graphs=max_graphs)
    return graphs, graphs.wrap(_affine, "affine")


def _args(seed: int, rows: int, scale: float = 2.0) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], float]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), (torch.randn(4, 3, generator=g), torch.randn(3, generator=g)), scale


def test_every_call_reads_its_own_inputs_and_keeps_its_outputs() -> None:
    """A signature met again computes from the new arguments (copied into its static inputs), and what an earlier
    call returned is not overwritten by the later one (outputs are copied out of the static outputs)."""
    graphs, fn = _graphed()
    first = fn(*_args(1, rows=5))
    first_values = [t.clone() for t in first]
    second = fn(*_args(2, rows=5))
    for got, args in ((first, _args(1, rows=5)), (second, _args(2, rows=5))):
        for have, want in zip(got, _affine(*args), strict=True):
            assert torch.equal(have, want)
    assert all(torch.equal(a, b) for a, b in zip(first, first_values, strict=True))
    assert len(fn) == 1 and graphs.captured == 1


def test_signatures_are_shapes_dtypes_and_plain_values() -> None:
    graphs, fn = _graphed()
    fn(*_args(1, rows=5))
    fn(*_args(1, rows=6))  # another shape
    fn(*_args(1, rows=5, scale=3.0))  # another constant: baked into a graph, so another signature
    x, pair, scale = _args(1, rows=5)
    fn(x.double(), tuple(t.double() for t in pair), scale)  # another dtype
    assert len(fn) == 4 and graphs.captured == 4
    for rows, scale in ((5, 2.0), (6, 2.0), (5, 3.0)):
        for have, want in zip(fn(*_args(7, rows, scale)), _affine(*_args(7, rows, scale)), strict=True):
            assert torch.equal(have, want)
    assert len(fn) == 4


def test_static_inputs_are_shared_by_signatures_with_the_same_argument_shape() -> None:
    """The weight pair has one shape whatever the rows: two signatures, one static buffer for each of its
    tensors (the cached prompt's tensors depend on the batch size, not on the bucket)."""
    _, fn = _graphed()
    fn(*_args(1, rows=5))
    fn(*_args(1, rows=6))
    assert len(fn._static) == 2 + 2  # x per row count, weight and bias once


def test_past_max_graphs_new_shapes_run_eagerly() -> None:
    graphs, fn = _graphed(max_graphs=2)
    for rows in (1, 2, 3, 4):
        for have, want in zip(fn(*_args(rows, rows)), _affine(*_args(rows, rows)), strict=True):
            assert torch.equal(have, want)
    assert len(fn) == 2 and graphs.captured == 2


def test_capture_needs_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphSet(capture=True)


def _simulated_capture(error: float) -> Callable[[ShapeGraphs, Any, Any], None]:
    """In place of ShapeGraphs._capture (no CUDA here): a "graph" whose replay computes the function over the static
    inputs and writes its outputs times (1 + error) into the static outputs, as a replay that went wrong would."""

    def capture(self: ShapeGraphs, entry: Any, spec: Any) -> None:
        args = tree_unflatten(entry.inputs, spec)
        outputs, entry.out_spec = tree_flatten(self.fn(*args))
        entry.outputs = [torch.empty_like(output) for output in outputs]

        def replay() -> None:
            for static, output in zip(entry.outputs, tree_flatten(self.fn(*args))[0], strict=True):
                static.copy_(output * (1 + error))

        entry.graph = StepGraph(replay, capture=False)

    return capture


@pytest.mark.parametrize(("error", "kept"), [(0.0, True), (2.0**-13, True), (2.0**-6, False)],
                         ids=["bitwise", "rounding", "wrong"])
def test_a_captured_shape_whose_first_replay_differs_from_eager_runs_eagerly(
        monkeypatch: pytest.MonkeyPatch, error: float, kept: bool) -> None:
    """Every shape's first replay, whenever it is captured (start-up or later), is compared with an eager call on the
    same inputs: bitwise or within REPLAY_TOLERANCE (float32: 2^-10 of the largest value) it is kept; further off,
    that shape runs eagerly from then on, counted in `mismatched`. Either way the caller gets eager's values."""
    graphs, fn = _graphed()
    graphs.capture = True  # (GraphSet refuses capture=True without CUDA; the capture itself is simulated)
    monkeypatch.setattr(ShapeGraphs, "_capture", _simulated_capture(error))
    for seed in (1, 2):  # the capture, then a call of the same signature
        got = fn(*_args(seed, rows=5))
        for have, want in zip(got, _affine(*_args(seed, rows=5)), strict=True):
            if kept:  # a kept graph's replays are what they are (within the tolerance)
                assert torch.allclose(have, want, rtol=2.0**-12, atol=0.0)
            else:
                assert torch.equal(have, want)
    assert (graphs.checked, graphs.mismatched, len(fn), graphs.captured) == ((1, 0, 1, 1) if kept else (0, 1, 0, 0))
    assert REPLAY_TOLERANCE[torch.float32] == 2.0**-10


def test_other_argument_types_are_refused() -> None:
    _, fn = _graphed()
    x, pair, _ = _args(1, rows=2)
    with pytest.raises(TypeError, match="plain values"):
        fn(x, pair, object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("variant", ["turbo", "english"])
def test_captured_vocoder_renders_what_eager_renders(variant: str) -> None:
    """On CUDA: the vocoder's renders replayed from captured graphs (several ticks: captures, then replays with
    new inputs) give the eager renders' PCM to float rounding (cuBLAS/cuDNN: the padded batch may move a row's
    last bits), and every signature was captured (none fell back to eager)."""
    from synth.tiny_s3gen import build_s3gen
    from synth.vocoder import StreamingVocoder

    from tests.synth.test_vocoder import PROMPT_TOKENS, SAMPLE_RATE_HZ, VARIANTS, reference_wav, utterance

    steps, meanflow, silence = VARIANTS[variant]
    torch.manual_seed(0)
    device = torch.device("cuda")
    s3gen = build_s3gen("tiny", meanflow).to(device)
    ref_dict = s3gen.embed_ref(reference_wav(), SAMPLE_RATE_HZ, device=device)
    outputs = []
    for graphed in (False, True):
        vocoder = StreamingVocoder(s3gen, n_cfm_timesteps=steps, meanflow=meanflow, append_silence_tokens=silence,
                                   prompt_max_tokens=PROMPT_TOKENS)
        graphs = vocoder.use_graphs() if graphed else None
        voice = vocoder.prepare_voice(ref_dict)
        streams = []
        for i in range(5):
            s = vocoder.open(voice, seed=40 + i)
            s.prompt = vocoder.prompt_cache(voice)
            s.add(utterance(120, seed=40 + i), final=True)
            streams.append(s)
        pcm: list[list[float]] = [[] for _ in streams]
        for chunk in (12, 24, 24, 12, 24):
            live = [(index, job) for index, job in enumerate(s.next_job(chunk) for s in streams) if job is not None]
            for (index, _), out in zip(live, vocoder.render([job for _, job in live]), strict=True):
                pcm[index].extend(out.tolist())
        outputs.append(pcm)
        if graphs is not None:
            assert graphs.captured > 0 and graphs.failed == 0
    for eager, replayed in zip(*outputs, strict=True):
        assert len(eager) == len(replayed) > 0
        assert max(abs(a - b) for a, b in zip(eager, replayed, strict=True)) < 1e-4
