"""CUDA graphs of the decode step and sampling, through the whole engine: replaying them gives the tokens the eager
step gives.

The segments are all in the inbox before the engine starts, so which steps admit which segment, and so which
(row bucket, key bucket) pairs they decode in, does not depend on timing: the graphed and the eager engine run the
same schedule (the runner-level parity of every kind of graph: tests/synth/test_graph_parity.py).

Opt-in (a CUDA device): `pytest -m gpu tests/synth/test_cuda_graphs.py`; skipped elsewhere, saying so. On the CPU the
same static-buffer functions run eagerly through the same `StepGraph` interface (every other engine test)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from synth import default_voice
from synth.api import EngineConfig, SamplingParams, SegmentRequest, Variant
from synth.engine import Engine
from synth.loading import random_bundle

from tests.synth.conftest import Collector

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: graphs are captured on a CUDA "
                                 "device (scripts/gpu_check.sh runs this there)")]

WAIT_S = 45.0  # a start (with its graph captures) and the segments, each
TEXTS = ["Hello world, this is a test.", "Another sentence to speak!", "Short one.", "A fourth, different text.",
         "Fifth text here please.", "Number six is on its way."]


def _tokens(variant: Variant, dtype: str, graphs: str) -> tuple[dict[str, list[int]], Engine]:
    bundle = random_bundle(variant, "tiny", torch.device("cuda"))  # one per engine: the runner casts it in place
    torch.manual_seed(0)
    engine = Engine(bundle, EngineConfig(variant=variant, weights="random-tiny", device="cuda", dtype=dtype,
                                         max_slots=8, max_context_tokens=512, cuda_graphs=graphs),
                    render_audio=False)
    engine.voices.add(default_voice(bundle))
    col = Collector()
    ids = []
    for i, text in enumerate(TEXTS):  # queued before the start: the schedule does not depend on timing
        params = replace(SamplingParams.defaults(variant), seed=100 + i, max_new_tokens=40)
        rid = f"g{i}"
        engine.submit(SegmentRequest(request_id=rid, text=text, params=params, sink=col.sink_for(rid)))
        ids.append(rid)
    engine.start()
    try:
        # (bounded well inside gpu_check's stage: a start that hangs is reported, not cut off by the bound)
        assert engine.wait_ready(WAIT_S), engine.failure
        col.wait_done(ids, WAIT_S)
        return {rid: col.tokens(rid) for rid in ids}, engine
    finally:
        engine.stop()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["english", "turbo"])
def test_graph_replay_tokens_equal_eager_tokens(variant: Variant, dtype: str) -> None:
    eager, eager_engine = _tokens(variant, dtype, "off")
    graphed, graphed_engine = _tokens(variant, dtype, "on")
    runner = graphed_engine.runner
    assert runner.use_graphs and not eager_engine.runner.use_graphs
    assert graphed_engine.status()["cuda_graphs_state"] == "on", graphed_engine.status()["cuda_graphs_reason"]
    assert runner._decode_graphs and all(g.captured for g in runner._decode_graphs.values())
    assert runner._sample_graphs and all(g.captured for g in runner._sample_graphs.values())
    assert len(runner._decode_graphs) == len(runner.row_buckets) * len(runner.key_buckets)  # all at start-up
    diverged = {rid: next((i for i, (a, b) in enumerate(zip(eager[rid], graphed[rid], strict=False)) if a != b),
                          min(len(eager[rid]), len(graphed[rid])))
                for rid in eager if graphed[rid] != eager[rid]}
    assert not diverged, f"graph replay left the eager tokens at step (per segment of {len(eager)}): {diverged}"
    assert len({tuple(t) for t in eager.values()}) == len(eager)  # the seeds really differ
